//! Replays every seed and every input a fuzzer ever crashed on (saved under
//! `fuzz/regressions/<target>/` by scripts/fuzz.sh) through the same checks
//! the fuzz targets run, on stable Rust and without libFuzzer.

use std::path::Path;

fn replay(target: &str, check: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut n = 0;
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        let mut paths: Vec<_> = entries.filter_map(|e| e.ok()).map(|e| e.path()).collect();
        paths.sort();
        for path in paths.into_iter().filter(|p| p.is_file()) {
            let data = std::fs::read(&path).unwrap();
            eprintln!("{target}: {}", path.display());
            check(&data);
            n += 1;
        }
    }
    assert!(n > 0, "no seeds for {target}");
}

#[test]
fn key_inputs_replay_clean() {
    replay("key", idemgate_fuzz::key);
}

#[test]
fn jcs_inputs_replay_clean() {
    replay("jcs", idemgate_fuzz::jcs);
}

#[test]
fn config_inputs_replay_clean() {
    replay("config", idemgate_fuzz::config);
}

#[test]
fn store_request_inputs_replay_clean() {
    replay("store_request", idemgate_fuzz::store_request);
}
