//! Role profiles: the allow-lists in `profiles/ROLE.txt`.
//!
//! One system call per line, by its x86-64 name; `#` starts a comment. For the calls whose
//! meaning lies in one argument (see [`crate::names::keyed_argument`]: ioctl, fcntl, madvise,
//! prctl, socket) a line may name the value allowed, `ioctl KVM_RUN`; such a call is then
//! allowed with the values its lines name only. `profiles/common.txt` is part of every role:
//! what any thread calls (memory allocation, locks, logging, thread exit, signal return).

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use syscalls::Sysno;

use crate::names::keyed_argument;
use crate::Role;

/// When a system call is allowed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Allow {
    Always,
    /// Only with argument `index` equal to one of `values`.
    When {
        index: u8,
        dword: bool,
        values: BTreeSet<u64>,
    },
}

/// A role's allow-list, by system call number.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Profile {
    pub calls: BTreeMap<Sysno, Allow>,
}

/// The text of each role's profile, as committed.
fn text(role: Role) -> &'static str {
    match role {
        Role::Main => include_str!("../profiles/main.txt"),
        Role::Launcher => include_str!("../profiles/launcher.txt"),
        Role::Vcpu => include_str!("../profiles/vcpu.txt"),
        Role::DeviceIo => include_str!("../profiles/device-io.txt"),
        Role::Api => include_str!("../profiles/api.txt"),
        Role::Migration => include_str!("../profiles/migration.txt"),
        Role::Timer => include_str!("../profiles/timer.txt"),
        Role::RestoreVerify => include_str!("../profiles/restore-verify.txt"),
        Role::RestoreFaults => include_str!("../profiles/restore-faults.txt"),
        Role::SerialInput => include_str!("../profiles/serial-input.txt"),
    }
}

const COMMON: &str = include_str!("../profiles/common.txt");

impl Profile {
    /// The role's own list plus the common one.
    pub fn of(role: Role) -> Result<Profile, String> {
        let mut profile = Profile::default();
        profile
            .add_text(COMMON)
            .map_err(|e| format!("profiles/common.txt: {e}"))?;
        profile
            .add_text(text(role))
            .map_err(|e| format!("profiles/{role}.txt: {e}"))?;
        Ok(profile)
    }

    /// Adds every line of a profile text.
    pub fn add_text(&mut self, text: &str) -> Result<(), String> {
        for (number, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            self.add_line(line)
                .map_err(|e| format!("line {}: {e}", number + 1))?;
        }
        Ok(())
    }

    fn add_line(&mut self, line: &str) -> Result<(), String> {
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or("");
        let sysno =
            Sysno::from_str(name).map_err(|_| format!("{name:?} is not an x86-64 system call"))?;
        let value = words.next();
        if let Some(extra) = words.next() {
            return Err(format!("{extra:?}: one value per line"));
        }
        let allow = match value {
            None => Allow::Always,
            Some(value) => {
                let keyed = keyed_argument(name)
                    .ok_or_else(|| format!("{name} takes no argument value in a profile"))?;
                let number = keyed
                    .value(value)
                    .ok_or_else(|| format!("{value:?} is not a known {name} value"))?;
                Allow::When {
                    index: keyed.index,
                    dword: keyed.dword,
                    values: BTreeSet::from([number]),
                }
            }
        };
        self.allow(sysno, allow);
        Ok(())
    }

    /// Allows `sysno` under `allow` as well as what was allowed already.
    pub fn allow(&mut self, sysno: Sysno, allow: Allow) {
        let merged = match (self.calls.remove(&sysno), allow) {
            (None, allow) => allow,
            (Some(Allow::Always), _) | (_, Allow::Always) => Allow::Always,
            (
                Some(Allow::When {
                    index,
                    dword,
                    mut values,
                }),
                Allow::When { values: more, .. },
            ) => {
                values.extend(more);
                Allow::When {
                    index,
                    dword,
                    values,
                }
            }
        };
        self.calls.insert(sysno, merged);
    }

    /// Allows everything `other` allows too.
    pub fn merge(&mut self, other: &Profile) {
        for (sysno, allow) in &other.calls {
            self.allow(*sysno, allow.clone());
        }
    }

    /// Whether the profile allows `sysno` (with any argument).
    #[cfg(test)]
    pub fn allows(&self, sysno: Sysno) -> bool {
        self.calls.contains_key(&sysno)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_committed_profile_parses() {
        for &role in Role::ALL {
            let profile = Profile::of(role).unwrap_or_else(|e| panic!("{e}"));
            // The SIGSYS reporter's calls are allowed everywhere.
            assert!(profile.allows(Sysno::write), "{role}");
            assert!(profile.allows(Sysno::exit_group), "{role}");
        }
    }

    #[test]
    fn keyed_lines_collect_their_values_and_a_bare_line_allows_all() {
        let mut p = Profile::default();
        p.add_text("ioctl KVM_RUN\nioctl KVM_GET_REGS # comment\n\nread\n")
            .unwrap();
        let Some(Allow::When { index, values, .. }) = p.calls.get(&Sysno::ioctl) else {
            panic!("ioctl not keyed: {p:?}");
        };
        assert_eq!(*index, 1);
        assert_eq!(values.len(), 2);
        assert_eq!(p.calls.get(&Sysno::read), Some(&Allow::Always));
        p.add_text("ioctl").unwrap();
        assert_eq!(p.calls.get(&Sysno::ioctl), Some(&Allow::Always));
    }

    #[test]
    fn mistakes_are_reported_with_their_line() {
        let mut p = Profile::default();
        assert!(p
            .add_text("read\nnot_a_call")
            .unwrap_err()
            .contains("line 2"));
        assert!(p
            .add_text("ioctl KVM_NOPE")
            .unwrap_err()
            .contains("KVM_NOPE"));
        assert!(p.add_text("read 3").unwrap_err().contains("no argument"));
        assert!(p.add_text("ioctl KVM_RUN KVM_NMI").is_err());
    }
}
