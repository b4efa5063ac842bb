//! The alert rules and the dashboard of `examples/monitoring/` against a real
//! Prometheus, run with the shipped `prometheus.yml`, scraping a running
//! stack: Envoy's `/stats/prometheus` (the filter's counters) and the
//! store's `/metrics`. After traffic with a first request, its replay, a
//! 422 and an unknown outcome, every rule loads and evaluates without error,
//! the signal of every alert and every dashboard expression returns data,
//! and the unknown outcome fires its alert until an operator resolves it.
//! `promtool` checks the rule file and runs its unit tests first.
//!
//! Both ways the filter's counters get their labels are run: the
//! bootstrap's `stats_tags` (envoy/e2e.yaml), and, for an Envoy without them
//! (an Istio sidecar), the relabeling in prometheus.yml that rebuilds the
//! same series from Envoy's flat names.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use e2e::stack::{Database, Options, Stack};
use e2e::{eventually, free_port, fresh_key, poll, repo_root, send, Proc};
use serde_json::Value;

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;
const OTHER: &str = r#"{"amount": 9900, "currency": "EUR"}"#;
/// Substituted for the dashboard's Grafana variables; a minute holds many
/// samples at one scrape a second.
const RATE_INTERVAL: &str = "1m";

/// `name` from `$<NAME>_BIN`, or the Debian package's binary.
fn tool(name: &str) -> PathBuf {
    let var = format!("{}_BIN", name.to_uppercase());
    let path = std::env::var_os(&var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(format!("/usr/bin/{name}")));
    assert!(
        path.exists(),
        "{path:?} is missing: run scripts/setup.sh (Debian's prometheus package) or set {var}"
    );
    path
}

fn promtool(args: &[&str]) {
    let dir = repo_root().join("examples/monitoring");
    let out = Command::new(tool("promtool"))
        .args(args)
        .current_dir(&dir)
        .output()
        .unwrap_or_else(|e| panic!("promtool: {e}"));
    assert!(
        out.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Percent-encodes a query parameter.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

struct Prometheus {
    _proc: Proc,
    port: u16,
    client: reqwest::Client,
}

impl Prometheus {
    /// Runs the shipped `examples/monitoring/prometheus.yml` against the
    /// stack: its jobs (with their relabeling) pointed at the stack's Envoy
    /// and store, scraping and evaluating the rule file every second.
    async fn start(stack: &Stack) -> Prometheus {
        let dir = stack.dir.path().join("prometheus");
        std::fs::create_dir_all(&dir).unwrap();
        let config = shipped_config(stack.admin_port, stack.stores[0].port);
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config).unwrap();
        let port = free_port();
        let proc = Proc::spawn(
            "prometheus",
            Command::new(tool("prometheus"))
                .arg(format!("--config.file={}", config_path.display()))
                .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
                .arg(format!("--web.listen-address=127.0.0.1:{port}"))
                .arg("--log.level=warn"),
            stack.dir.path().join("prometheus.log"),
        );
        let prometheus = Prometheus {
            _proc: proc,
            port,
            client: reqwest::Client::new(),
        };
        eventually("Prometheus to be ready", Duration::from_secs(20), || async {
            prometheus.get("/-/ready").await.is_some()
        })
        .await;
        prometheus
    }

    async fn get(&self, path: &str) -> Option<String> {
        let res = self
            .client
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .send()
            .await
            .ok()?;
        if !res.status().is_success() {
            return None;
        }
        res.text().await.ok()
    }

    /// The `data` of an API answer whose status is success.
    async fn api(&self, path: &str) -> Value {
        let text = self
            .get(path)
            .await
            .unwrap_or_else(|| panic!("Prometheus did not answer {path}"));
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
        assert_eq!(v["status"], "success", "{path}: {text}");
        v["data"].clone()
    }

    /// An instant query's result.
    async fn query(&self, expr: &str) -> Vec<Value> {
        let path = format!("/api/v1/query?query={}", encode(expr));
        let text = self.client_query(&path).await;
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{expr}: {e}: {text}"));
        assert_eq!(v["status"], "success", "the query {expr} failed: {text}");
        match &v["data"]["result"] {
            // A vector's samples, or a scalar's [time, value].
            Value::Array(items) => items.clone(),
            other => panic!("{expr}: unexpected result {other}"),
        }
    }

    /// The raw answer, also when Prometheus refuses the query (400).
    async fn client_query(&self, path: &str) -> String {
        let res = self
            .client
            .get(format!("http://127.0.0.1:{}{path}", self.port))
            .send()
            .await
            .unwrap_or_else(|e| panic!("Prometheus: {e}"));
        res.text().await.unwrap_or_default()
    }

    /// The first sample's value of `expr`, if it has one.
    async fn value(&self, expr: &str) -> Option<f64> {
        let result = self.query(expr).await;
        let sample = result.first()?;
        sample["value"][1].as_str()?.parse().ok()
    }
}

/// `examples/monitoring/prometheus.yml` as shipped, but for its targets (the
/// stack's Envoy admin and store), its intervals (a second) and the rule
/// file's path (absolute).
fn shipped_config(envoy: u16, store: u16) -> String {
    let dir = repo_root().join("examples/monitoring");
    let text = std::fs::read_to_string(dir.join("prometheus.yml")).unwrap();
    let rules = dir.join("alerts.yaml");
    let mut config = text;
    for (from, to) in [
        ("scrape_interval: 15s", "scrape_interval: 1s".to_string()),
        ("evaluation_interval: 15s", "evaluation_interval: 1s".to_string()),
        ("- alerts.yaml", format!("- {rules:?}")),
        ("'127.0.0.1:9901'", format!("'127.0.0.1:{envoy}'")),
        ("'127.0.0.1:8787'", format!("'127.0.0.1:{store}'")),
    ] {
        assert_eq!(
            config.matches(from).count(),
            1,
            "examples/monitoring/prometheus.yml: expected one `{from}`"
        );
        config = config.replace(from, &to);
    }
    config
}

/// An alert's signal: its expression without a trailing comparison with a
/// number (`<signal> > 0.05` is `<signal>`), which returns data whether or
/// not the alert fires.
fn signal(expr: &str) -> String {
    let expr = expr.trim();
    for op in [" > ", " >= ", " < ", " <= ", " == ", " != "] {
        if let Some(i) = expr.rfind(op) {
            if expr[i + op.len()..].trim().parse::<f64>().is_ok() {
                return expr[..i].trim().to_string();
            }
        }
    }
    expr.to_string()
}

/// Every `expr` in the dashboard (panels' targets), with Grafana's
/// variables replaced, and each template variable's `label_values(m, l)`
/// as `count by (l) (m)`.
fn dashboard_expressions() -> Vec<String> {
    let path = repo_root().join("examples/monitoring/dashboard.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let dashboard: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    let mut out = Vec::new();
    collect_exprs(&dashboard["panels"], &mut out);
    for var in dashboard["templating"]["list"].as_array().into_iter().flatten() {
        let Some(q) = var["definition"].as_str() else {
            continue;
        };
        let inner = q
            .strip_prefix("label_values(")
            .and_then(|r| r.strip_suffix(')'))
            .unwrap_or_else(|| panic!("template query {q}: only label_values(metric, label) is checked"));
        let (metric, label) = inner.rsplit_once(',').unwrap();
        out.push(format!("count by ({}) ({})", label.trim(), metric.trim()));
    }
    out.iter()
        .map(|e| {
            e.replace("$__rate_interval", RATE_INTERVAL)
                .replace("${policy}", ".*")
                .replace("$policy", ".*")
        })
        .collect()
}

fn collect_exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

/// Waits until every rule of the rule file has been evaluated, asserts that
/// each is healthy and that each alert's signal and each dashboard
/// expression returns data; the numbers of rules and expressions.
async fn every_expression_has_data(prometheus: &Prometheus) -> (usize, usize) {
    let groups = poll("the rules evaluated", Duration::from_secs(15), || async {
        let data = prometheus.api("/api/v1/rules").await;
        let groups = data["groups"].as_array().cloned().unwrap_or_default();
        let rules: Vec<Value> = groups
            .iter()
            .flat_map(|g| g["rules"].as_array().cloned().unwrap_or_default())
            .collect();
        let evaluated = !rules.is_empty()
            && rules.iter().all(|r| {
                r["lastEvaluation"]
                    .as_str()
                    .is_some_and(|t| !t.starts_with("0001"))
            });
        evaluated.then_some(rules)
    })
    .await;
    let mut expressions = Vec::new();
    for rule in &groups {
        assert_eq!(
            rule["health"], "ok",
            "rule {} has {}",
            rule["name"], rule["lastError"]
        );
        expressions.push((
            format!("alert {}", rule["name"]),
            signal(rule["query"].as_str().unwrap()),
        ));
    }
    assert_eq!(expressions.len(), 13, "{expressions:?}");
    for expr in dashboard_expressions() {
        expressions.push(("dashboard".to_string(), expr));
    }
    let mut empty = Vec::new();
    for (what, expr) in &expressions {
        // A rate needs two samples in its window: give the scrapes a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while prometheus.query(expr).await.is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        if prometheus.query(expr).await.is_empty() {
            empty.push(format!("{what}: {expr}"));
        }
    }
    assert!(empty.is_empty(), "no data for:\n{}", empty.join("\n"));
    (groups.len(), expressions.len())
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_reads_every_series_the_alerts_and_the_dashboard_use() {
    let started = Instant::now();
    promtool(&["check", "rules", "alerts.yaml"]);
    promtool(&["test", "rules", "alerts.test.yaml"]);

    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    // The resolve below names its operator, as an authenticating proxy on
    // this host would (docs/operations.md#operator-identity-and-audit).
    options.store_args = vec!["--operator-trusted-peers".into(), "127.0.0.1".into()];
    let stack = Stack::start(options).await;
    let prometheus = Prometheus::start(&stack).await;
    // Both targets scraped, before the traffic: its counters then rise.
    eventually("both targets up", Duration::from_secs(20), || async {
        let up = prometheus.query("sum(up)").await;
        up.first().and_then(|s| s["value"][1].as_str()) == Some("2")
    })
    .await;

    // A first request and its replay, a 422 with the same key, and an
    // upstream reset after forwarding: an unknown outcome.
    let key = fresh_key("prom");
    assert_eq!(send(stack.post("/pay", Some(&key), PAYMENT)).await.status, 201);
    let replay = send(stack.post("/pay", Some(&key), PAYMENT)).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{replay:?}");
    let reused = send(stack.post("/pay", Some(&key), OTHER)).await;
    assert_eq!(reused.problem().as_deref(), Some("key-reused"), "{reused:?}");
    let reset = fresh_key("prom-reset");
    let lost = send(
        stack
            .post("/pay", Some(&reset), PAYMENT)
            .header("x-test-reset", "1"),
    )
    .await;
    assert!(lost.status >= 500, "{lost:?}");

    // The filter's counters arrive with their labels.
    for (outcome, n) in [("owned", 2.0), ("replayed", 1.0), ("mismatch", 1.0)] {
        let expr = format!(r#"sum(idemgate_requests_total{{outcome="{outcome}",policy="payments.create"}})"#);
        eventually(&expr, Duration::from_secs(15), || async {
            prometheus.value(&expr).await == Some(n)
        })
        .await;
    }
    let unknown = r#"sum(idemgate_records_total{outcome="marked_unknown",policy="payments.create"})"#;
    eventually(unknown, Duration::from_secs(15), || async {
        prometheus.value(unknown).await == Some(1.0)
    })
    .await;
    // The relabeling for flat names leaves labelled series alone: a policy
    // keeps its `-` (the flat-name path would read `fail.open`).
    assert!(!prometheus
        .query(r#"idemgate_requests_total{policy="fail-open"}"#)
        .await
        .is_empty());
    assert!(prometheus
        .query(r#"idemgate_requests_total{policy="fail.open"}"#)
        .await
        .is_empty());

    // Every rule loaded and evaluates; each alert's signal has data.
    let (rules, expressions) = every_expression_has_data(&prometheus).await;

    // The unknown outcome fires its alert; the 422 shows in its ratio.
    eventually(
        "IdemgateUnknownRecords to fire",
        Duration::from_secs(15),
        || async {
            let alerts = prometheus.api("/api/v1/alerts").await;
            alerts["alerts"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|a| a["labels"]["alertname"] == "IdemgateUnknownRecords" && a["state"] == "firing")
        },
    )
    .await;
    // It stays on until an operator resolves the record, then clears.
    let history = stack
        .history("tenant-a", "alice", "payments.create", &reset)
        .await
        .expect("the unknown record's history");
    let record = history["records"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|r| r["ended_at"].is_null())
        .cloned()
        .expect("the unknown record");
    let resolve = serde_json::json!({ "scope": record["scope"], "action": "release", "reason": "refunded" });
    let answer = reqwest::Client::new()
        .post(stack.store_url(0, "/admin/v1/resolve"))
        .bearer_auth(e2e::ADMIN_TOKEN)
        .header("x-forwarded-email", "oncall@example.com")
        .header("content-type", "application/json")
        .body(resolve.to_string())
        .send()
        .await
        .unwrap();
    assert!(answer.status().is_success(), "{answer:?}");
    eventually(
        "IdemgateUnknownRecords to clear",
        Duration::from_secs(20),
        || async {
            let alerts = prometheus.api("/api/v1/alerts").await;
            !alerts["alerts"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|a| a["labels"]["alertname"] == "IdemgateUnknownRecords")
        },
    )
    .await;
    let ratio = prometheus
        .value(&format!(
            r#"sum(increase(idemgate_requests_total{{outcome="mismatch",policy="payments.create"}}[{RATE_INTERVAL}])) / sum(increase(idemgate_requests_total{{policy="payments.create"}}[{RATE_INTERVAL}]))"#
        ))
        .await;
    assert!(ratio.is_some_and(|r| r > 0.0), "422 ratio {ratio:?}");

    let took = started.elapsed();
    println!(
        "prometheus: {expressions} expressions with data ({rules} rules) in {:.1} s",
        took.as_secs_f64()
    );
}

/// Whether alert `name` fires.
async fn firing(prometheus: &Prometheus, name: &str) -> bool {
    let alerts = prometheus.api("/api/v1/alerts").await;
    alerts["alerts"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|a| a["labels"]["alertname"] == name && a["state"] == "firing")
}

/// A filter VM that fails (the fault-injection build, under e2e.yaml's
/// `failure_policy: FAIL_RELOAD`) fires IdemgateWasmVmFailed from Envoy's
/// own VM counters.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_filter_vm_fires_its_alert() {
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.wasm = Some(e2e::env_path(
        "IDEMGATE_FAULTY_WASM",
        "target/idemgate-faulty.wasm",
    ));
    let stack = Stack::start(options).await;
    let prometheus = Prometheus::start(&stack).await;
    let created = "envoy_wasm_envoy_wasm_runtime_v8_created";
    eventually(
        "Envoy's VM counter scraped twice",
        Duration::from_secs(20),
        || async { prometheus.value(&format!("count_over_time({created}[1m])")).await >= Some(2.0) },
    )
    .await;
    assert!(
        !firing(&prometheus, "IdemgateWasmVmFailed").await,
        "fires before any failure"
    );
    let vms = "wasm.envoy.wasm.runtime.v8.created";
    let before = stack.stat(vms).await;
    let failed = send(
        stack
            .post("/pay", Some(&fresh_key("vm-alert")), PAYMENT)
            .header("x-idemgate-fault", "request"),
    )
    .await;
    assert!(failed.status == 0 || failed.status == 503, "{failed:?}");
    // Envoy reloads a failed VM when a request of its worker needs it, after
    // its backoff: new connections until one lands there.
    eventually("the VM to be reloaded", Duration::from_secs(20), || async {
        let probe = reqwest::Client::new()
            .post(stack.url("/pay"))
            .header("idempotency-key", fresh_key("vm-probe"))
            .header("x-tenant-id", "tenant-a")
            .header("x-user-id", "alice")
            .header("content-type", "application/json")
            .body(PAYMENT)
            .send()
            .await;
        drop(probe);
        stack.stat(vms).await > before
    })
    .await;
    eventually(
        "IdemgateWasmVmFailed to fire",
        Duration::from_secs(30),
        || async { firing(&prometheus, "IdemgateWasmVmFailed").await },
    )
    .await;
}

/// The info gauges on the stats_tags path: the running version, and each
/// policy's rollout (1 for its own, 0 for the others).
#[tokio::test(flavor = "multi_thread")]
async fn the_info_gauges_name_the_version_and_each_policys_rollout() {
    let stack = Stack::start(Options::new("envoy/e2e.yaml", Database::Sqlite, 1)).await;
    let text = stack.admin_text("/stats/prometheus").await;
    // A series' value, whatever the order of its labels.
    let value = |family: &str, labels: &[(&str, &str)]| {
        text.lines().find_map(|l| {
            let (series, v) = l.rsplit_once(' ')?;
            let inner = series
                .strip_prefix(family)?
                .strip_prefix('{')?
                .strip_suffix('}')?;
            let mut got: Vec<&str> = inner.split(',').collect();
            let mut want: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{v}\"")).collect();
            got.sort_unstable();
            want.sort_unstable();
            (got == want).then(|| v.parse::<f64>().ok()).flatten()
        })
    };
    // The filter's series pass Prometheus's own lint (counters end in
    // `_total`, among its rules).
    let ours: String = text
        .lines()
        .filter(|l| l.contains(" idemgate_") || l.starts_with("idemgate_"))
        .map(|l| format!("{l}\n"))
        .collect();
    let mut lint = Command::new(tool("promtool"))
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut lint.stdin.take().unwrap(), ours.as_bytes()).unwrap();
    let lint = lint.wait_with_output().unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    // Envoy writes no HELP lines for any stat: not the filter's to fix.
    let problems: Vec<&str> = said
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.ends_with("no help text"))
        .collect();
    assert!(problems.is_empty(), "promtool check metrics: {problems:?}");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        value("idemgate_build_info", &[("version", version)]),
        Some(1.0),
        "{text}"
    );
    for (mode, policy, on) in [
        ("enforce", "payments.create", 1.0),
        ("observe", "payments.create", 0.0),
        ("canary", "payments.create", 0.0),
        ("observe", "observe", 1.0),
        ("canary", "canary", 1.0),
    ] {
        let labels = [("mode", mode), ("policy", policy)];
        assert_eq!(value("idemgate_policy_info", &labels), Some(on), "{labels:?}");
    }
}

#[test]
fn an_alerts_signal_is_its_expression_without_the_threshold() {
    assert_eq!(
        signal("sum(rate(x[5m])) / sum(rate(y[5m])) > 0.05"),
        "sum(rate(x[5m])) / sum(rate(y[5m]))"
    );
    assert_eq!(signal("time() - max(t) > 120"), "time() - max(t)");
    assert_eq!(signal("max(a) > b"), "max(a) > b");
}

#[test]
fn a_flat_names_policy_reads_with_a_dot_for_each_punctuation() {
    assert_eq!(relabelled("payments.create"), "payments.create");
    assert_eq!(relabelled("short-lived.new"), "short.lived.new");
    assert_eq!(relabelled("payment_intents.create"), "payment.intents.create");
    assert_eq!(relabelled("_a.b_"), "_a.b_");
    assert_eq!(relabelled("a.b.c.d.e.f.g.h.i.j"), "a_b.c.d.e.f.g.h.i.j");
}

/// The `stats_tags` that cut the labels out of the filter's stat names are
/// written out in every bootstrap, the Istio patch and the operations guide:
/// they must be the same everywhere (e2e.yaml's are the ones the tests run).
#[test]
fn every_bootstrap_cuts_the_same_labels_out_of_the_filters_stat_names() {
    fn tags(file: &str) -> Vec<(String, String)> {
        let text = std::fs::read_to_string(repo_root().join(file)).unwrap();
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        lines
            .windows(2)
            .filter_map(|w| {
                let name = w[0].strip_prefix("- tag_name: ")?;
                let regex = w[1].strip_prefix("regex: ")?;
                regex
                    .contains("wasmcustom")
                    .then(|| (name.to_string(), regex.to_string()))
            })
            .collect()
    }
    let reference = tags("envoy/e2e.yaml");
    let names: Vec<&str> = reference.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["outcome", "policy", "reason", "mode", "version"]);
    for file in [
        "envoy/chaos.yaml",
        "envoy/demo.yaml",
        "examples/compose/envoy.yaml",
        "examples/istio/stats.yaml",
        "docs/operations.md",
    ] {
        assert_eq!(tags(file), reference, "{file}");
    }
}

/// `envoy/e2e.yaml` without its `stats_config`: Envoy exposes the filter's
/// counters under flat names, as an Istio sidecar (whose bootstrap nobody
/// patches) does.
fn without_stats_config(config: String) -> String {
    let start = config
        .find("\nstats_config:\n")
        .expect("envoy/e2e.yaml has a top-level stats_config")
        + 1;
    let end = start
        + config[start..]
            .find("\nstatic_resources:")
            .expect("stats_config is followed by static_resources")
        + 1;
    let mut cut = config;
    cut.replace_range(start..end, "");
    assert!(!cut.contains("stats_tags"), "{cut}");
    cut
}

/// A filter counter's series on the `stats_tags` path: its family
/// (`requests` or `records`), outcome, reason and policy, cut out of the
/// stat name as envoy/e2e.yaml's tag extractors cut them.
type Series = (String, String, Option<String>, String);

fn tagged(name: &str) -> Option<Series> {
    let rest = name.strip_prefix("wasmcustom.idemgate.")?;
    let (family, rest) = rest.split_once("_total.outcome.")?;
    let (outcome, rest) = rest.split_once('.')?;
    let (reason, policy) = match rest.strip_prefix("reason.") {
        Some(r) => {
            let (reason, rest) = r.split_once('.')?;
            (Some(reason.to_string()), rest.strip_prefix("policy.")?)
        }
        None => (None, rest.strip_prefix("policy.")?),
    };
    Some((
        family.to_string(),
        outcome.to_string(),
        reason,
        policy.to_string(),
    ))
}

/// A policy's name as the relabeling of prometheus.yml reads it: Envoy's
/// flat name has `_` for every character other than a letter, a digit or
/// `_`; the relabeling turns the last 8 `_` that have a character on each
/// side into `.`.
fn relabelled(policy: &str) -> String {
    let mut chars: Vec<char> = policy
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let last = chars.len().saturating_sub(1);
    let mut left = 8;
    for i in (1..last).rev() {
        if left > 0 && chars[i] == '_' {
            chars[i] = '.';
            left -= 1;
        }
    }
    chars.into_iter().collect()
}

/// Every series of `idemgate_requests_total` and `idemgate_records_total` Prometheus
/// holds, with its value.
async fn labelled_series(prometheus: &Prometheus) -> BTreeMap<Series, u64> {
    let mut out = BTreeMap::new();
    for family in ["requests", "records"] {
        for sample in prometheus.query(&format!("idemgate_{family}_total")).await {
            let label = |l: &str| sample["metric"][l].as_str().map(str::to_string);
            let value: f64 = sample["value"][1].as_str().unwrap().parse().unwrap();
            out.insert(
                (
                    family.to_string(),
                    label("outcome").unwrap_or_default(),
                    label("reason"),
                    label("policy").unwrap_or_default(),
                ),
                value as u64,
            );
        }
    }
    out
}

/// What the `stats_tags` path would show, read from Envoy's `/stats`, with
/// each policy named as the relabeling reads it.
async fn expected_series(stack: &Stack) -> BTreeMap<Series, u64> {
    let text = stack.admin_text("/stats?filter=wasmcustom.idemgate.").await;
    text.lines()
        .filter_map(|l| l.split_once(": "))
        .filter_map(|(name, v)| {
            let (family, outcome, reason, policy) = tagged(name)?;
            Some((
                (family, outcome, reason, relabelled(&policy)),
                v.trim().parse().ok()?,
            ))
        })
        .collect()
}

/// Istio's path: no `stats_tags` in Envoy's bootstrap, so the filter's
/// counters reach `/stats/prometheus` as flat names
/// (`idemgate_requests_total_outcome_owned_policy_payments_create`), and the
/// relabeling of the shipped prometheus.yml rebuilds the labelled series the
/// alerts and the dashboard query. After traffic with every outcome they
/// name (owned, replayed, 422, in progress, unknown, store errors, fail-open,
/// observe mode's reasons; all but a failed settlement, whose series stays
/// at 0), Prometheus holds exactly the series the `stats_tags` path gives
/// (policies named as the relabeling reads them), and every alert's signal
/// and every dashboard expression returns data.
#[tokio::test(flavor = "multi_thread")]
async fn without_stats_tags_the_shipped_relabeling_rebuilds_the_labelled_series() {
    let started = Instant::now();
    promtool(&["check", "config", "prometheus.yml"]);
    let mut options = Options::new("envoy/e2e.yaml", Database::Sqlite, 1);
    options.edit = Some(Box::new(without_stats_config));
    let mut stack = Stack::start(options).await;
    let exposed = stack.admin_text("/stats/prometheus").await;
    assert!(
        exposed
            .lines()
            .any(|l| l.starts_with("idemgate_requests_total_outcome_owned_policy_payments_create{")),
        "no flat name in Envoy's /stats/prometheus:\n{}",
        exposed
            .lines()
            .filter(|l| l.contains("idemgate"))
            .take(20)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        !exposed.lines().any(|l| l.starts_with("idemgate_requests_total{")),
        "Envoy still labels the filter's counters"
    );
    let prometheus = Prometheus::start(&stack).await;
    eventually("both targets up", Duration::from_secs(20), || async {
        let up = prometheus.query("sum(up)").await;
        up.first().and_then(|s| s["value"][1].as_str()) == Some("2")
    })
    .await;

    // payments.create: a first request, its replay, a 422, an upstream reset
    // (unknown), and a retry while the first of its key still runs (409
    // request-in-progress).
    let key = fresh_key("flat");
    assert_eq!(send(stack.post("/pay", Some(&key), PAYMENT)).await.status, 201);
    let replay = send(stack.post("/pay", Some(&key), PAYMENT)).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"), "{replay:?}");
    let reused = send(stack.post("/pay", Some(&key), OTHER)).await;
    assert_eq!(reused.problem().as_deref(), Some("key-reused"), "{reused:?}");
    let reset = fresh_key("flat-reset");
    let lost = send(
        stack
            .post("/pay", Some(&reset), PAYMENT)
            .header("x-test-reset", "1"),
    )
    .await;
    assert!(lost.status >= 500, "{lost:?}");
    let slow_key = fresh_key("flat-slow");
    let slow = tokio::spawn(send(
        stack
            .post("/pay", Some(&slow_key), PAYMENT)
            .header("x-test-delay-ms", "1500"),
    ));
    eventually("the slow request upstream", Duration::from_secs(5), || async {
        stack.upstream.executions(&slow_key) == 1
    })
    .await;
    let retry = send(stack.post("/pay", Some(&slow_key), PAYMENT)).await;
    assert_eq!(retry.status, 409, "{retry:?}");
    // The store dies while the slow request runs: a new key fails closed
    // (store_error, its claim abandoned) and fail-open's passes unprotected
    // (fail_open). The slow request's outcome reaches the store once it is
    // back (the worker retries it): completed. Observe mode counts a missing
    // key by its reason.
    stack.kill_store(0);
    let settled = slow.await.unwrap();
    assert!(settled.status > 0, "{settled:?}");
    let dead = send(stack.post("/pay", Some(&fresh_key("flat-dead")), PAYMENT)).await;
    assert_eq!(dead.problem().as_deref(), Some("store-unavailable"), "{dead:?}");
    let open = send(stack.post("/open", Some(&fresh_key("flat-open")), PAYMENT)).await;
    assert_eq!(open.status, 201, "{open:?}");
    stack.start_store(0);
    stack.wait_store(0).await;
    assert_eq!(send(stack.post("/observe", None, PAYMENT)).await.status, 201);

    // Prometheus holds the series of the stats_tags path, with the same
    // values (the traffic's among them, once the slow request's outcome has
    // reached the store), and no flat name is left.
    let traffic: Vec<(Series, u64)> = [
        (("requests", "owned", None, "payments.create"), 3),
        (("requests", "replayed", None, "payments.create"), 1),
        (("requests", "mismatch", None, "payments.create"), 1),
        (("requests", "conflict", None, "payments.create"), 1),
        (("requests", "store_error", None, "payments.create"), 1),
        (("requests", "fail_open", None, "fail.open"), 1),
        (("requests", "would_reject", Some("missing"), "observe"), 1),
        (("records", "completed", None, "payments.create"), 2),
        (("records", "abandoned", None, "payments.create"), 1),
        (("records", "marked_unknown", None, "payments.create"), 1),
        // A settlement fails only once the worker gives up retrying, longer
        // than this test: the series is there at 0 (IdemgateSettlementsFailing
        // then has data, its value 0).
        (("records", "settle_failed", None, "payments.create"), 0),
    ]
    .into_iter()
    .map(|((family, outcome, reason, policy), n)| {
        let series = (
            family.to_string(),
            outcome.to_string(),
            reason.map(str::to_string),
            policy.to_string(),
        );
        (series, n)
    })
    .collect();
    let deadline = Instant::now() + Duration::from_secs(15);
    let got = loop {
        let want = expected_series(&stack).await;
        let got = labelled_series(&prometheus).await;
        let counted = traffic.iter().all(|(k, n)| got.get(k) == Some(n));
        if !want.is_empty() && want == got && counted {
            break got;
        }
        if Instant::now() > deadline {
            let missing: Vec<_> = want
                .iter()
                .filter(|(k, v)| got.get(*k) != Some(v))
                .take(10)
                .collect();
            let extra: Vec<_> = got
                .iter()
                .filter(|(k, _)| !want.contains_key(*k))
                .take(10)
                .collect();
            let counts: Vec<_> = traffic
                .iter()
                .map(|(k, n)| (k, n, got.get(k)))
                .filter(|(_, n, got)| *got != Some(n))
                .collect();
            panic!(
                "Prometheus has {} filter series, the stats_tags path {}; missing or different: {missing:?}; unexpected: {extra:?}; traffic's counts (series, expected, Prometheus): {counts:?}",
                got.len(),
                want.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let flat = prometheus
        .query(r#"{__name__=~"idemgate_(requests|records)_total_.+"}"#)
        .await;
    assert!(flat.is_empty(), "flat names left: {flat:?}");
    // The info gauges too.
    let version = env!("CARGO_PKG_VERSION");
    for (series, on) in [
        (format!(r#"idemgate_build_info{{version="{version}"}}"#), 1.0),
        (
            r#"idemgate_policy_info{mode="enforce",policy="payments.create"}"#.to_string(),
            1.0,
        ),
        (
            r#"idemgate_policy_info{mode="observe",policy="payments.create"}"#.to_string(),
            0.0,
        ),
        (
            r#"idemgate_policy_info{mode="observe",policy="observe"}"#.to_string(),
            1.0,
        ),
    ] {
        assert_eq!(prometheus.value(&series).await, Some(on), "{series}");
    }
    let flat = prometheus
        .query(r#"{__name__=~"idemgate_(build|policy)_info_.+"}"#)
        .await;
    assert!(flat.is_empty(), "flat info names left: {flat:?}");

    let (rules, expressions) = every_expression_has_data(&prometheus).await;
    println!(
        "prometheus without stats_tags: {} labelled series, {expressions} expressions with data ({rules} rules) in {:.1} s",
        got.len(),
        started.elapsed().as_secs_f64()
    );
}
