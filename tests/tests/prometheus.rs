//! The alert rules and the dashboard of `examples/monitoring/` against a real
//! Prometheus scraping a running stack: Envoy's `/stats/prometheus` (the
//! filter's counters, labelled by the bootstrap's `stats_tags`) and the
//! store's `/metrics`. After traffic with a first request, its replay, a
//! 422 and an unknown outcome, every rule loads and evaluates without error,
//! the signal of every alert and every dashboard expression returns data,
//! and the unknown outcome fires its alert until an operator resolves it.
//! `promtool` checks the rule file and runs its unit tests first.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

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
    /// Scrapes the stack's Envoy and store every second and evaluates the
    /// rule file every second.
    async fn start(stack: &Stack) -> Prometheus {
        let dir = stack.dir.path().join("prometheus");
        std::fs::create_dir_all(&dir).unwrap();
        let rules = repo_root().join("examples/monitoring/alerts.yaml");
        let config = format!(
            "global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: [{rules:?}]
scrape_configs:
- job_name: envoy
  metrics_path: /stats/prometheus
  static_configs: [{{targets: ['127.0.0.1:{envoy}']}}]
- job_name: idempotency-store
  metrics_path: /metrics
  static_configs: [{{targets: ['127.0.0.1:{store}']}}]
",
            envoy = stack.admin_port,
            store = stack.stores[0].port,
        );
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
        let expr = format!(r#"sum(idemgate_requests{{outcome="{outcome}",policy="payments.create"}})"#);
        eventually(&expr, Duration::from_secs(15), || async {
            prometheus.value(&expr).await == Some(n)
        })
        .await;
    }
    let unknown = r#"sum(idemgate_records{outcome="marked_unknown",policy="payments.create"})"#;
    eventually(unknown, Duration::from_secs(15), || async {
        prometheus.value(unknown).await == Some(1.0)
    })
    .await;

    // Every rule loaded and evaluates; each alert's signal has data.
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
    assert_eq!(expressions.len(), 9, "{expressions:?}");
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
            r#"sum(increase(idemgate_requests{{outcome="mismatch",policy="payments.create"}}[{RATE_INTERVAL}])) / sum(increase(idemgate_requests{{policy="payments.create"}}[{RATE_INTERVAL}]))"#
        ))
        .await;
    assert!(ratio.is_some_and(|r| r > 0.0), "422 ratio {ratio:?}");

    let took = started.elapsed();
    println!(
        "prometheus: {} expressions with data ({} rules) in {:.1} s",
        expressions.len(),
        groups.len(),
        took.as_secs_f64()
    );
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
    assert_eq!(names, ["outcome", "policy", "reason"]);
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
