//! Human-readable migration figures.

use vmm::api::types::MigrationReport;

pub fn print_migration(reply: &MigrationReport) {
    let report = match reply.figures() {
        Ok(figures) => figures,
        Err(e) => return println!("unreadable migration report: {e}"),
    };
    if report.rounds.is_empty() {
        // A local update: guest RAM was handed over, no page sent.
        println!("no page sent (guest RAM handed over)");
    } else {
        println!("round  duration_ms  pages_sent  zero_pages  MiB_sent  dirty_found");
    }
    for r in &report.rounds {
        println!(
            "{:>5}  {:>11.1}  {:>10}  {:>10}  {:>8.1}  {:>11}",
            r.index,
            r.duration_ms,
            r.pages_sent,
            r.zero_pages,
            r.bytes_sent as f64 / 1048576.0,
            r.dirty_pages_found,
        );
    }
    println!(
        "total {:.1} ms, downtime {:.1} ms, {:.1} MiB sent, converged: {}",
        report.total_ms,
        report.downtime_ms,
        report.bytes_total as f64 / 1048576.0,
        report.converged,
    );
    if let Some(pc) = &report.postcopy {
        println!(
            "post-copy after {} rounds: {} pages missing at the switch, {} fetched on demand \
             ({} requests), {} streamed, {:.1} MiB; full residency {:.1} ms after the pause",
            pc.after_rounds,
            pc.missing_pages,
            pc.pages_on_demand,
            pc.requests,
            pc.pages_streamed,
            pc.bytes as f64 / 1048576.0,
            pc.time_to_residency_ms,
        );
    }
}
