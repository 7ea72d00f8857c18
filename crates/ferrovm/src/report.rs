//! Human-readable migration figures.

use serde_json::Value;

pub fn print_migration(v: &Value) {
    let report = &v["report"];
    if let Some(rounds) = report["rounds"].as_array() {
        println!("round  duration_ms  pages_sent  zero_pages  MiB_sent  dirty_found");
        for r in rounds {
            println!(
                "{:>5}  {:>11.1}  {:>10}  {:>10}  {:>8.1}  {:>11}",
                r["index"].as_u64().unwrap_or(0),
                r["duration_ms"].as_f64().unwrap_or(0.0),
                r["pages_sent"].as_u64().unwrap_or(0),
                r["zero_pages"].as_u64().unwrap_or(0),
                r["bytes_sent"].as_u64().unwrap_or(0) as f64 / 1048576.0,
                r["dirty_pages_found"].as_u64().unwrap_or(0),
            );
        }
    }
    println!(
        "total {:.1} ms, downtime {:.1} ms, {:.1} MiB sent, converged: {}",
        report["total_ms"].as_f64().unwrap_or(0.0),
        report["downtime_ms"].as_f64().unwrap_or(0.0),
        report["bytes_total"].as_u64().unwrap_or(0) as f64 / 1048576.0,
        report["converged"],
    );
    let pc = &report["postcopy"];
    if pc.is_object() {
        println!(
            "post-copy after {} rounds: {} pages missing at the switch, {} fetched on demand \
             ({} requests), {} streamed, {:.1} MiB; full residency {:.1} ms after the pause",
            pc["after_rounds"].as_u64().unwrap_or(0),
            pc["missing_pages"].as_u64().unwrap_or(0),
            pc["pages_on_demand"].as_u64().unwrap_or(0),
            pc["requests"].as_u64().unwrap_or(0),
            pc["pages_streamed"].as_u64().unwrap_or(0),
            pc["bytes"].as_u64().unwrap_or(0) as f64 / 1048576.0,
            pc["time_to_residency_ms"].as_f64().unwrap_or(0.0),
        );
    }
}
