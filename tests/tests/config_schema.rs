//! The published JSON Schema of the filter's configuration
//! (`docs/config.schema.json`) is the one the configuration types generate;
//! `IDEMGATE_WRITE_SCHEMA=1` rewrites it. scripts/validate-plugin-configs.py
//! checks every shipped configuration against it.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

#[test]
fn the_published_schema_is_the_generated_one() {
    let path = e2e::repo_root().join("docs/config.schema.json");
    let generated = serde_json::to_string_pretty(&idemgate_core::config::json_schema()).unwrap() + "\n";
    if std::env::var_os("IDEMGATE_WRITE_SCHEMA").is_some() {
        std::fs::write(&path, &generated).unwrap();
    }
    let published = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        published == generated,
        "{} is not the schema the configuration types generate: run IDEMGATE_WRITE_SCHEMA=1 cargo test -p e2e --test main -- config_schema::",
        path.display()
    );
}

#[test]
fn the_schema_knows_every_policy_field_and_refuses_others() {
    let schema = idemgate_core::config::json_schema();
    let text = schema.to_string();
    for field in [
        "forwarding",
        "settle",
        "in_flight",
        "token_env",
        "max_stored_body",
        "release_statuses",
    ] {
        assert!(
            text.contains(&format!("\"{field}\"")),
            "{field} missing from the schema"
        );
    }
    assert!(
        text.contains("\"additionalProperties\":false"),
        "the schema allows unknown fields"
    );
}
