//! The store's modules form layers: none leads back to itself through the
//! modules it imports, however long the way round, read with each folder as
//! one module (`sqlite/` is one) and file by file. A cycle is where a change
//! to a low module (the error type, the column mapping) starts depending on
//! what is built on it (a backend), and where the trait would start naming
//! its implementations. The crate root (`lib.rs`: the module list,
//! `AppState`, `run`) is left out, since it declares every module and holds
//! only what the HTTP surface shares.
//!
//! The graph is read from the sources (`idemgate_testkit::layers`): a node
//! per file (`sqlite::engine::writer`), an edge wherever a file's code names
//! another through a `crate::` or `super::` path; tests may reach anything.

use std::path::Path;

use idemgate_testkit::layers::{self, Graph};

/// The modules below the storage trait: the trait re-exports their types,
/// so none of them may reach it (or anything above it) in turn.
const BELOW_THE_TRAIT: &[&str] = &[
    "calls",
    "clock",
    "error",
    "log_ids",
    "records",
    "row_mapping",
    "scope_digest",
    "sealing",
];

/// The store's graph, without the crate root.
fn store_graph() -> Graph {
    let mut graph = layers::read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    graph.remove("crate");
    for named in graph.values_mut() {
        named.remove("crate");
    }
    graph
}

#[test]
fn no_two_of_the_stores_modules_import_each_other() {
    let graph = layers::folders(&store_graph());
    assert!(
        graph.contains_key("backend") && graph.contains_key("sqlite"),
        "{graph:?}"
    );
    layers::assert_no_cycle(&graph, "modules");
}

#[test]
fn no_file_leads_back_to_itself() {
    let graph = store_graph();
    assert!(
        graph.contains_key("sqlite::engine::writer") && graph.contains_key("postgres"),
        "{:?}",
        graph.keys()
    );
    layers::assert_no_cycle(&graph, "files");
}

#[test]
fn the_modules_below_the_storage_trait_never_reach_it() {
    let graph = layers::folders(&store_graph());
    for module in BELOW_THE_TRAIT {
        assert!(graph.contains_key(*module), "no module {module}");
        let reached = layers::reach(&graph, module);
        assert!(
            !reached.contains("backend"),
            "{module} reaches the trait: it imports {reached:?}"
        );
    }
}

/// `lib.rs` is the store's guide: every top-level module of `src/` is
/// declared there with one line saying what it holds.
#[test]
fn the_guide_names_every_module_in_one_line() {
    layers::assert_the_guide_names_every_module(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
}
