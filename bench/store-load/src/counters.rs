//! Readers of the process's CPU time and context switches, and of the backend's write metrics.

use std::sync::Arc;

use idemgate_store::backend::Backend;

/// Context switches of every thread of this process so far (voluntary and
/// not), from `/proc/self/task/*/status`; 0 where there is no `/proc`.
/// CPU time (user + system) of the whole process so far, every thread's,
/// those that ended included, in µs: /proc/self/stat counts USER_HZ ticks,
/// 100 a second on Linux.
pub(crate) fn cpu_us() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0;
    };
    // utime and stime, fields 14 and 15: the 12th and 13th after the command
    // name, which is in parentheses and may hold spaces.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0;
    };
    rest.split_whitespace()
        .skip(11)
        .take(2)
        .filter_map(|v| v.parse::<u64>().ok())
        .sum::<u64>()
        * 10_000
}

pub(crate) fn context_switches() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// The backend's write metrics (stage timers, commit and checkpoint
/// counters) as `/metrics` renders them.
fn writer_metrics(backend: &Arc<dyn Backend>) -> String {
    let mut metrics = idemgate_store::metrics::Metrics::new();
    metrics.writer_stages(backend.writer_stages());
    metrics.render()
}

/// The value of the series `name` in rendered metrics (0 when absent).
fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0)
}

/// The backend's commits, durable commits and WAL checkpoints so far.
pub(crate) fn commit_counts(backend: &Arc<dyn Backend>) -> [f64; 3] {
    let text = writer_metrics(backend);
    ["write_commits", "write_durable_commits", "wal_checkpoints"]
        .map(|c| metric(&text, &format!("idemgate_store_{c}_total")))
}

/// The sum and count of each of the backend's write stage timers, by name.
pub(crate) fn stage_totals(backend: &Arc<dyn Backend>) -> Vec<(String, f64, f64)> {
    let text = writer_metrics(backend);
    let value = |name: &str| metric(&text, name);
    ["queued", "transaction", "commit"]
        .iter()
        .map(|stage| {
            let base = format!("idemgate_store_write_{stage}_seconds");
            (
                stage.to_string(),
                value(&format!("{base}_sum")),
                value(&format!("{base}_count")),
            )
        })
        .collect()
}

/// Mean milliseconds of each write stage between two [`stage_totals`].
pub(crate) fn stage_means(before: &[(String, f64, f64)], after: &[(String, f64, f64)]) -> String {
    before
        .iter()
        .zip(after)
        .filter(|(_, a)| a.2 > 0.0)
        .map(|(b, a)| format!("{} {:.3} ms", a.0, (a.1 - b.1) / (a.2 - b.2).max(1.0) * 1000.0))
        .collect::<Vec<_>>()
        .join(", ")
}
