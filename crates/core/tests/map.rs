//! The developer map kept true: the problem pages match the problem kinds,
//! and the README's layout and ARCHITECTURE.md name every file of the
//! filter and its worker.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use idemgate_core::problem::ProblemKind;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn read(path: &str) -> String {
    std::fs::read_to_string(root().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The names of the files in `dir` ending in `ext`, without it.
fn stems(dir: &str, ext: &str) -> BTreeSet<String> {
    std::fs::read_dir(root().join(dir))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter_map(|name| name.strip_suffix(ext).map(str::to_string))
        .collect()
}

#[test]
fn every_problem_kind_has_its_page_with_its_status_and_title() {
    let pages = stems("docs/problems", ".md");
    let kinds: BTreeSet<String> = ProblemKind::ALL.iter().map(|k| k.slug().to_string()).collect();
    assert_eq!(pages, kinds, "docs/problems/*.md and ProblemKind::ALL differ");
    for kind in ProblemKind::ALL {
        let page = read(&format!("docs/problems/{}.md", kind.slug()));
        let status = format!("| status | `{} ", kind.status());
        let title = format!("| title | {} |", kind.title());
        assert!(page.contains(&status), "{}: no `{status}`", kind.slug());
        assert!(page.contains(&title), "{}: no `{title}`", kind.slug());
    }
}

#[test]
fn the_readme_layout_and_the_architecture_name_every_file_of_the_filter_and_its_worker() {
    let readme = read("README.md");
    let layout = readme
        .split("## Layout")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README.md has a Layout section");
    let architecture = read("ARCHITECTURE.md");
    for dir in ["src", "crates/worker/src"] {
        for file in stems(dir, ".rs") {
            let name = format!("{file}.rs");
            assert!(
                layout.contains(&name),
                "README's layout does not name {dir}/{name}"
            );
            assert!(
                architecture.contains(&name),
                "ARCHITECTURE.md does not name {dir}/{name}"
            );
        }
    }
}
