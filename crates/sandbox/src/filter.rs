//! Turning role profiles into BPF programs with seccompiler.

use std::collections::{BTreeMap, HashMap};

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch,
};
use syscalls::Sysno;

use crate::profile::{Allow, Profile};
use crate::{Error, Mode, Role};

/// Profile lines a role gets beyond its file: what the VMM's device kinds declare they
/// need (see [`crate::start_with`]).
pub(crate) type Extra<'a> = &'a [(Role, &'a str)];

/// The complete allow-list of `role`: its profile and its `extra` lines. The launcher's is
/// the union of every role's: the threads it creates run under its filter until they
/// install their own, and their own can only narrow it.
pub(crate) fn role_profile(role: Role, extra: Extra) -> Result<Profile, Error> {
    let load = |role: Role| {
        let mut profile = Profile::of(role).map_err(|reason| Error::Filter { role, reason })?;
        for (_, text) in extra.iter().filter(|(r, _)| *r == role) {
            profile.add_text(text).map_err(|reason| Error::Filter {
                role,
                reason: format!("a device kind's needs: {reason}"),
            })?;
        }
        Ok(profile)
    };
    let mut profile = load(role)?;
    if role == Role::Launcher {
        for &other in Role::ALL {
            profile.merge(&load(other)?);
        }
    }
    Ok(profile)
}

/// Every role's filter for `mode` (not `Off`).
pub(crate) fn compile_all(mode: Mode, extra: Extra) -> Result<HashMap<Role, BpfProgram>, Error> {
    Role::ALL
        .iter()
        .map(|&role| {
            let program = compile(&role_profile(role, extra)?, mode)
                .map_err(|reason| Error::Filter { role, reason })?;
            Ok((role, program))
        })
        .collect()
}

fn condition(
    index: u8,
    dword: bool,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, String> {
    let len = if dword {
        SeccompCmpArgLen::Dword
    } else {
        SeccompCmpArgLen::Qword
    };
    SeccompCondition::new(index, len, op, value).map_err(|e| e.to_string())
}

/// The rules of one allowed call; an empty list allows it whatever its arguments.
fn rules(sysno: Sysno, allow: &Allow) -> Result<Vec<SeccompRule>, String> {
    let rule = |c: SeccompCondition| SeccompRule::new(vec![c]).map_err(|e| e.to_string());
    match allow {
        // No thread maps memory executable: the VMM never generates code.
        Allow::Always if matches!(sysno, Sysno::mmap | Sysno::mprotect) => {
            let exec = libc::PROT_EXEC as u64;
            Ok(vec![rule(condition(
                2,
                true,
                SeccompCmpOp::MaskedEq(exec),
                0,
            )?)?])
        }
        Allow::Always => Ok(Vec::new()),
        Allow::When {
            index,
            dword,
            values,
        } => values
            .iter()
            .map(|&v| rule(condition(*index, *dword, SeccompCmpOp::Eq, v)?))
            .collect(),
    }
}

/// The BPF program allowing what `profile` allows; anything else traps (`kill`) or is
/// logged (`log`).
pub(crate) fn compile(profile: &Profile, mode: Mode) -> Result<BpfProgram, String> {
    let mismatch = match mode {
        Mode::Kill => SeccompAction::Trap,
        Mode::Log => SeccompAction::Log,
        Mode::Off => return Err("no filter in mode off".into()),
    };
    let mut map = BTreeMap::new();
    for (sysno, allow) in &profile.calls {
        map.insert(i64::from(sysno.id()), rules(*sysno, allow)?);
    }
    let filter = SeccompFilter::new(map, mismatch, SeccompAction::Allow, TargetArch::x86_64)
        .map_err(|e| e.to_string())?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_role_compiles_in_both_modes_within_the_kernel_limit() {
        for mode in [Mode::Kill, Mode::Log] {
            let programs = compile_all(mode, &[]).unwrap();
            for (role, program) in &programs {
                // BPF_MAXINSNS.
                assert!(
                    program.len() <= 4096,
                    "{role}: {} instructions",
                    program.len()
                );
            }
        }
    }

    #[test]
    fn the_launcher_allows_what_every_role_allows() {
        let launcher = role_profile(Role::Launcher, &[]).unwrap();
        for &role in Role::ALL {
            for sysno in role_profile(role, &[]).unwrap().calls.keys() {
                assert!(launcher.allows(*sysno), "{role}: {sysno}");
            }
        }
    }
}
