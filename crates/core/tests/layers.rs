//! The core's files form layers: none leads back to itself through the
//! files it imports, however long the way round, and neither does a folder
//! read as one module. At the bottom the words everything shares (the
//! lexicon of header lines, what became of a request, a key, a path); above
//! them the configuration; above it the frames, which carry some of its
//! words, and a store call with its answer; above those the store client,
//! which delivers calls and never names the exchange; at the top the
//! exchange, which hands the client its letters.
//! A cycle is where a low file starts depending on what is built on it, and
//! where one change starts to need all the files on its circle.
//! The crate root is the guide to those floors, with one line per module.
//!
//! The graph is read from the sources (`idemgate_testkit::layers`): a node
//! per file (`exchange::head`, `client::letters`), an edge wherever a file's
//! code names another through a `crate::` or `super::` path; tests may
//! reach anything.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use idemgate_testkit::layers::{self, Graph};

fn core_graph() -> Graph {
    layers::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"))
}

/// Modules that import nothing of the crate: every other may use them.
const GROUND: &[&str] = &["handling", "headers", "jcs", "key", "origin", "path"];

/// Folders that never lead to the ones named with them.
const NEVER_REACH: &[(&str, &[&str])] = &[
    ("config", &["protocol", "store_call", "client", "exchange"]),
    ("store_call", &["client", "exchange"]),
    ("client", &["exchange"]),
];

/// `lib.rs` is the core's guide: every top-level module of `src/` is
/// declared there with one line saying what it holds.
#[test]
fn the_guide_names_every_module_in_one_line() {
    layers::assert_the_guide_names_every_module(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
}

#[test]
fn no_file_of_the_core_leads_back_to_itself() {
    let graph = core_graph();
    for file in [
        "exchange",
        "exchange::head",
        "client::letters",
        "config::raw",
        "crate",
    ] {
        assert!(graph.contains_key(file), "no {file} in {:?}", graph.keys());
    }
    layers::assert_no_cycle(&graph, "files");
}

#[test]
fn no_folder_of_the_core_leads_back_to_itself() {
    let graph = layers::folders(&core_graph());
    layers::assert_no_cycle(&graph, "folders");
}

#[test]
fn the_ground_floor_imports_nothing_and_the_floors_above_keep_apart() {
    let graph = layers::folders(&core_graph());
    for module in GROUND {
        let named = graph.get(*module).unwrap_or_else(|| panic!("no module {module}"));
        assert!(named.is_empty(), "{module} imports {named:?}");
    }
    for (module, above) in NEVER_REACH {
        assert!(graph.contains_key(*module), "no module {module}");
        let reached = layers::reach(&graph, module);
        for a in *above {
            assert!(!reached.contains(*a), "{module} leads to {a}: {reached:?}");
        }
    }
}

#[test]
fn the_reader_follows_groups_climbs_and_lines_and_skips_tests_comments_and_literals() {
    let named = |code: &str, module: &[&str]| -> Vec<String> {
        layers::named(code, module).iter().map(|p| p.join("::")).collect()
    };
    assert_eq!(
        named("use crate::{a::{b, c}, d as e, f::*};", &["x"]),
        ["a::b", "a::c", "d", "f::*"]
    );
    assert_eq!(
        named(
            "use crate::protocol::{\n    encode_frame,\n    Frame,\n};",
            &["x"]
        ),
        ["protocol::encode_frame", "protocol::Frame"]
    );
    assert_eq!(
        named("use super::super::columns::X;", &["sqlite", "engine", "writer"]),
        ["sqlite::columns::X"]
    );
    assert_eq!(
        named("use super::{Writer, step::Step};", &["a", "b"]),
        ["a::Writer", "a::step::Step"]
    );
    assert_eq!(named("use super::*;", &["config"]), ["*"]);
    assert_eq!(
        named("pub(in crate::sqlite) fn f()", &["sqlite", "x"]),
        ["sqlite"]
    );
    // A struct literal's brace is no group.
    assert_eq!(
        named("crate::client::Letter {\n call,\n}", &["x"]),
        ["client::Letter"]
    );
    assert!(named("use idemgate_crate::x; use a::super::b; use super::c;", &[]).is_empty());
    let not_code = "// crate::a\n/* crate::b /* crate::c */ */\nlet s = \"crate::d\\\"\";\n\
                    let r = r#\"crate::e\"#; let q = '\"'; let l: &'static str = b\"crate::f\";\n\
                    #[cfg(test)]\nmod tests {\n    use crate::g;\n}\n#[cfg(test)]\nuse crate::h;\nuse crate::i;";
    assert_eq!(named(not_code, &["x"]), ["i"]);

    let graph: Graph = [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d::e", "a")]
        .iter()
        .fold(Graph::new(), |mut g, (from, to)| {
            g.entry(from.to_string())
                .or_default()
                .insert(to.to_string(), String::new());
            g.entry(to.to_string()).or_default();
            g
        });
    assert_eq!(layers::cycles(&graph), [["a", "b", "c"]]);
    assert_eq!(layers::cycles(&layers::folders(&graph)), [["a", "b", "c", "d"]]);
    assert!(layers::reach(&graph, "d").is_empty() && layers::reach(&graph, "a").contains("d"));
}
