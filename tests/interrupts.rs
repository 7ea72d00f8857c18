//! SMP and interrupt delivery, checked by guests that observe it, in both irqchip modes and
//! with 1, 2 and 4 vCPUs.

mod common;

use common::*;

const MODES: [&str; 2] = ["kernel", "split"];
const CPU_COUNTS: [&str; 3] = ["1", "2", "4"];

/// Runs `name` in every mode and vCPU count; each run must end with PASS (status 1).
fn passes_everywhere(name: &str, extra: &[&str]) -> Vec<Run> {
    let mut runs = Vec::new();
    for mode in MODES {
        for cpus in CPU_COUNTS {
            let mut args = vec!["--irqchip", mode, "--cpus", cpus];
            args.extend_from_slice(extra);
            let run = run_guest(name, &args);
            eprintln!(
                "{name} --irqchip {mode} --cpus {cpus}: {:?}, last line {:?}",
                run.elapsed,
                run.last_line()
            );
            run.expect_status(1);
            assert_eq!(
                run.last_line(),
                "PASS",
                "{name} {mode} {cpus}:\n{}",
                run.stdout
            );
            runs.push(run);
        }
    }
    runs
}

#[test]
fn smp_every_ap_starts_and_reports_its_apic_id() {
    for (run, cpus) in passes_everywhere("smp", &[])
        .iter()
        .zip(CPU_COUNTS.iter().cycle())
    {
        let n: usize = cpus.parse().unwrap();
        run.expect_stdout(&format!("smp: {n} of {n} CPUs up"));
        let mut ids: Vec<u32> = run
            .stdout
            .lines()
            .find_map(|l| l.split("apic ids:").nth(1))
            .expect("the BSP lists the APIC IDs it saw")
            .split_whitespace()
            .map(|id| id.parse().unwrap())
            .collect();
        ids.sort_unstable();
        assert_eq!(ids, (0..n as u32).collect::<Vec<_>>());
        for id in 1..n {
            // Every AP reports itself.
            assert!(
                run.stdout.contains(&format!("apic_id {id}")),
                "{}",
                run.stdout
            );
        }
    }
}

#[test]
fn ipi_between_every_pair_and_broadcast() {
    for run in passes_everywhere("ipi", &[]) {
        run.expect_stdout("all delivered");
    }
}

/// NMI IPIs reach every AP, in ring 3 and in ring 0 with interrupts off: Linux's RCU
/// stall reports and all-CPU backtraces depend on them (docs/linux-guest.md, "Two vCPUs").
#[test]
fn nmi_ipis_reach_every_ap() {
    for run in passes_everywhere("nmi", &[]) {
        if !run.stdout.contains("nmi: 1 CPUs") {
            run.expect_stdout("nmi: cpu 1 got 8/8 (ring 3) 8/8 (ring 0, IF=0)");
        }
    }
}

#[test]
fn ioapic_routes_to_the_programmed_vcpu() {
    passes_everywhere("ioapic-route", &[]);
}

#[test]
fn fast_timer_does_not_starve_another_line() {
    passes_everywhere("irq-starvation", &[]);
}

#[test]
fn ten_thousand_interrupts_none_lost_none_duplicated() {
    for run in passes_everywhere("vector-integrity", &[]) {
        run.expect_stdout("0 lost, 0 duplicated");
    }
}

/// A level-triggered line is delivered again until its EOI, and not after.
///
/// The PVM host these tests run on has a LAPIC that EOIs level-triggered interrupts at
/// delivery (the ISR bit is never set; QEMU fails identically here), so "until its EOI" cannot
/// be observed by a guest. The guest proves that diagnosis (TMR set, ISR never set in any
/// handler) and, given it, checks what ferrovm does control: every raise taken exactly once
/// with the source asserted, and remote IRR clear at the end. On a correct LAPIC the guest
/// must PASS outright. The IOAPIC's own level/EOI semantics are also unit-tested in
/// `devices::irqchip::ioapic`.
#[test]
fn level_triggered_line_redelivers_until_eoi() {
    for mode in MODES {
        for cpus in CPU_COUNTS {
            let run = run_guest("level-eoi", &["--irqchip", mode, "--cpus", cpus]);
            eprintln!(
                "level-eoi {mode} {cpus}: {:?} {}",
                run.elapsed,
                run.last_line()
            );
            if run.last_line() == "PASS" {
                run.expect_status(1);
                continue;
            }
            run.expect_stdout("host LAPIC does not hold level interrupts until EOI (ISR never set")
                .expect_stdout("ISR set 0,")
                .expect_stdout("C 10 raises taken with IRQF set")
                .expect_stdout("remote IRR clear at the end yes");
        }
    }
}

#[test]
fn pic_mode_interrupts_before_any_ioapic_entry() {
    passes_everywhere("pic-mode", &[]);
}

#[test]
fn tpr_holds_back_lower_priority_interrupts() {
    passes_everywhere("tpr", &[]);
}

/// The BSP's timer rate with the APs spinning must stay above a third of its fair share of
/// the host (all of it while the host has a CPU per vCPU; `host / vcpus` beyond), and never
/// below the guest's default 25%: a VMM that lets spinners starve it drops to a few percent,
/// while a fair one on a busy 2-CPU host measured 0.24-0.42 with 4 vCPUs.
#[test]
fn pause_spinning_aps_do_not_starve_the_bsp_timer() {
    let host = std::thread::available_parallelism().map_or(1, |n| n.get());
    for mode in MODES {
        for cpus in CPU_COUNTS {
            let vcpus: usize = cpus.parse().unwrap();
            let min_pct = (100 * host.min(vcpus) / vcpus / 3).min(25);
            let cmdline = format!("min_pct={min_pct}");
            let args = ["--irqchip", mode, "--cpus", cpus, "--cmdline", &cmdline];
            let run = run_guest("pause-spin", &args);
            run.expect_status(1).expect_stdout("pause-spin: idle rate");
            assert_eq!(run.last_line(), "PASS", "{mode} {cpus}:\n{}", run.stdout);
        }
    }
}

#[test]
fn qemu_built_kernels_run_unchanged_with_two_cpus() {
    // The single-protocol builds are what QEMU's -kernel loads (Multiboot for -M pc, PVH for
    // microvm); both must run unchanged here, discovering the CPU count through fw_cfg.
    require_kvm();
    for flavour in ["multiboot-only", "pvh-only"] {
        let kernel = guest("smp").parent().unwrap().join(flavour).join("smp.elf");
        let run = ferrovm(
            &["run", "--kernel", kernel.to_str().unwrap(), "--cpus", "2"],
            std::time::Duration::from_secs(120),
        );
        run.expect_status(1).expect_stdout("smp: 2 of 2 CPUs up");
        assert_eq!(run.last_line(), "PASS");
    }
}
