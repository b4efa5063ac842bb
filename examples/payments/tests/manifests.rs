//! Every YAML file under examples/ and envoy/ parses, and every idemgate plugin
//! configuration in them (Envoy bootstraps, the Istio EnvoyFilter and
//! WasmPlugin) is accepted by the filter's own parser, so a reader who copies
//! one gets a configuration the filter loads.

// Helpers of a test file are test code too: fail loudly.
#![allow(clippy::unwrap_used, clippy::panic)]

use std::path::{Path, PathBuf};

use idemgate_core::config::Config;
use serde::Deserialize;
use serde_norway::Value;

const STRING_VALUE: &str = "type.googleapis.com/google.protobuf.StringValue";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn yaml_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            yaml_files(&path, out);
        } else if matches!(path.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")) {
            out.push(path);
        }
    }
}

/// (file, document) for every YAML document under examples/ and envoy/.
fn documents() -> Vec<(String, Value)> {
    let mut files = Vec::new();
    yaml_files(&repo().join("examples"), &mut files);
    yaml_files(&repo().join("envoy"), &mut files);
    assert!(
        files.len() >= 10,
        "expected the example manifests, found {files:?}"
    );
    let mut docs = Vec::new();
    for path in files {
        let name = path.strip_prefix(repo()).unwrap_or(&path).display().to_string();
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, doc) in serde_norway::Deserializer::from_str(&text).enumerate() {
            let value = Value::deserialize(doc).unwrap_or_else(|e| panic!("{name}, document {i}: {e}"));
            if !value.is_null() {
                docs.push((name.clone(), value));
            }
        }
    }
    docs
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.as_mapping().and_then(|m| m.get(key))
}

/// Plugin configurations (as JSON text) and wasm `config` blocks in a document.
fn walk<'a>(v: &'a Value, configs: &mut Vec<String>, wasm: &mut Vec<&'a Value>) {
    match v {
        Value::Mapping(m) => {
            if let Some(c) = m.get("configuration") {
                if get(c, "@type").and_then(Value::as_str) == Some(STRING_VALUE) {
                    configs.push(
                        get(c, "value")
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                            .to_string(),
                    );
                }
            }
            if m.contains_key("vm_config") {
                wasm.push(v);
            }
            m.values().for_each(|v| walk(v, configs, wasm));
        }
        Value::Sequence(s) => s.iter().for_each(|v| walk(v, configs, wasm)),
        _ => {}
    }
}

#[test]
fn every_plugin_configuration_in_the_examples_is_one_the_filter_accepts() {
    let mut seen = 0;
    for (file, doc) in documents() {
        let (mut configs, mut wasm) = (Vec::new(), Vec::new());
        walk(&doc, &mut configs, &mut wasm);
        if get(&doc, "kind").and_then(Value::as_str) == Some("WasmPlugin") {
            let plugin = get(&doc, "spec").and_then(|s| get(s, "pluginConfig")).unwrap();
            configs.push(serde_json::to_string(plugin).unwrap());
        }
        for config in configs {
            // `token_env` names the proxy's variable, set from a Secret there.
            let env = |_: &str| Some("example-token".to_string());
            if let Err(e) = Config::parse_with_env(config.as_bytes(), &env) {
                panic!("{file}: the filter rejects its configuration: {e}");
            }
            seen += 1;
        }
        for config in wasm {
            let flag = get(config, "allow_on_headers_stop_iteration").and_then(Value::as_bool);
            assert_eq!(
                flag,
                Some(true),
                "{file}: a wasm filter without allow_on_headers_stop_iteration: true hangs"
            );
            // What readers copy recreates a crashed VM; test bootstraps may differ on purpose.
            if file.starts_with("examples/") || file == "envoy/demo.yaml" {
                let policy = get(config, "failure_policy").and_then(Value::as_str);
                assert_eq!(
                    policy,
                    Some("FAIL_RELOAD"),
                    "{file}: set failure_policy: FAIL_RELOAD"
                );
            }
        }
    }
    // envoy/demo.yaml, envoy/e2e.yaml, compose/envoy.yaml, EnvoyFilter, WasmPlugin
    assert!(seen >= 5, "found only {seen} plugin configurations");
}

#[test]
fn kubernetes_and_istio_manifests_name_their_kind() {
    for (file, doc) in documents() {
        // Not Kubernetes objects: Prometheus rule files and their promtool
        // tests (promtool checks them, scripts/validate-manifests.sh), and
        // JSON patches, which are lists of operations.
        let prometheus = file.ends_with(".rules.yaml") || file.ends_with(".test.yaml");
        if prometheus
            || doc.is_sequence()
            || !(file.starts_with("examples/kubernetes/") || file.starts_with("examples/istio/"))
        {
            continue;
        }
        for key in ["apiVersion", "kind"] {
            assert!(
                get(&doc, key).and_then(Value::as_str).is_some(),
                "{file}: a document without {key}"
            );
        }
        let name = get(&doc, "metadata")
            .and_then(|m| get(m, "name"))
            .and_then(Value::as_str);
        assert!(name.is_some(), "{file}: a document without metadata.name");
    }
}

fn plugin_config(file: &str) -> Config {
    let doc = documents()
        .into_iter()
        .find(|(f, _)| f == file)
        .map(|(_, d)| d)
        .unwrap();
    let (mut configs, mut wasm) = (Vec::new(), Vec::new());
    walk(&doc, &mut configs, &mut wasm);
    assert_eq!(configs.len(), 1, "{file}: one idemgate configuration expected");
    Config::parse(configs[0].as_bytes()).unwrap()
}

#[test]
fn the_demo_filter_and_store_share_one_token_and_compose_runs_the_same_policies() {
    let demo = plugin_config("envoy/demo.yaml");
    // `make demo` starts its stack with idemgate-stack's demo shape.
    let stack = std::fs::read_to_string(repo().join("tests/src/bin/idemgate-stack.rs")).unwrap();
    assert!(
        demo.store()
            .authorization()
            .strip_prefix("Bearer ")
            .is_some_and(|token| stack.contains(&format!("(\"{token}\", "))),
        "idemgate-stack's demo shape must start the store with the token of envoy/demo.yaml"
    );
    let compose = plugin_config("examples/compose/envoy.yaml");
    assert_eq!(
        demo, compose,
        "examples/compose/envoy.yaml drifted from envoy/demo.yaml"
    );
}

#[test]
fn the_istio_delivery_runs_after_authorization_on_a_known_istio_and_strips_identity_headers() {
    let docs = documents();
    let find = |file: &str, kind: &str| {
        docs.iter()
            .find(|(f, d)| f == file && get(d, "kind").and_then(Value::as_str) == Some(kind))
            .map(|(_, d)| d.clone())
            .unwrap_or_else(|| panic!("{file}: no {kind}"))
    };
    let plugin = find("examples/istio/wasmplugin.yaml", "WasmPlugin");
    let spec = get(&plugin, "spec").unwrap();
    assert_eq!(
        get(spec, "phase").and_then(Value::as_str),
        Some("STATS"),
        "the WasmPlugin must run after Istio's authorization (phase STATS)"
    );
    let filter = find("examples/istio/envoyfilter.yaml", "EnvoyFilter");
    let patches = get(get(&filter, "spec").unwrap(), "configPatches")
        .and_then(Value::as_sequence)
        .unwrap();
    for patch in patches {
        let version = get(patch, "match")
            .and_then(|m| get(m, "proxy"))
            .and_then(|p| get(p, "proxyVersion"))
            .and_then(Value::as_str);
        assert!(
            version.is_some(),
            "every EnvoyFilter patch needs a proxyVersion guard: {patch:?}"
        );
    }
    let text = serde_norway::to_string(&filter).unwrap();
    for header in ["x-tenant-id", "x-user-id"] {
        assert!(
            text.contains(&format!("remove: {header}")),
            "the EnvoyFilter must strip client-sent {header}"
        );
    }
}
