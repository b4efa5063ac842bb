//! The store's top-level modules form layers: no two of them import each
//! other, directly or through others. A cycle is where a change to a low
//! module (the error type, the column mapping) starts depending on what is
//! built on it (a backend), and where the trait would start naming its
//! implementations. A module and its own submodules are one node; the crate
//! root (`lib.rs`: the module list, `AppState`, `run`) is left out, since it
//! declares every module and holds only what the HTTP surface shares.
//!
//! The graph is read from the sources: every `crate::NAME` path and every
//! `super::` path that climbs to the crate root, outside comments and test
//! files (`tests.rs`, `tests/`), where tests may reach anything.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module name to the modules it names, with a file and line for each.
type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// The modules below the storage trait: the trait re-exports their types,
/// so none of them may reach it (or anything above it) in turn.
const BELOW_THE_TRAIT: &[&str] = &[
    "calls",
    "clock",
    "columns",
    "error",
    "log_ids",
    "records",
    "scope_digest",
    "sealing",
];

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "tests") {
                rust_files(&path, into);
            }
        } else if path.extension().is_some_and(|e| e == "rs")
            && path.file_name().is_some_and(|n| n != "tests.rs")
        {
            into.push(path);
        }
    }
}

/// The module path of a file under `src/`: `sqlite/engine/writer.rs` is
/// `[sqlite, engine, writer]`, `sqlite/mod.rs` is `[sqlite]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "mod" {
            parts.push(stem.to_string());
        }
    }
    parts
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn ident_at(s: &str) -> &str {
    let end = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
    &s[..end]
}

/// The first name of each item of a `{…}` group (`{a::b, c}`: `a`, `c`);
/// `group` starts just after the `{`.
fn group_heads(group: &str) -> Vec<String> {
    let (mut heads, mut depth, mut start) = (Vec::new(), 0usize, true);
    for (i, c) in group.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => break,
            '}' => depth -= 1,
            ',' if depth == 0 => start = true,
            c if start && depth == 0 && is_ident(c) => {
                heads.push(ident_at(&group[i..]).to_string());
                start = false;
            }
            _ => {}
        }
    }
    heads
}

/// The top-level modules a line of code names, seen from `module`.
fn named_modules(line: &str, module: &[String]) -> Vec<String> {
    let mut named = Vec::new();
    let paths = line.match_indices("crate::").chain(line.match_indices("super::"));
    for (at, word) in paths {
        if line[..at].ends_with(|c: char| is_ident(c) || c == ':') {
            continue; // `x::crate::`, or a later `super::` of one chain
        }
        let mut rest = &line[at..];
        if word == "super::" {
            let mut depth = module.len();
            while let Some(r) = rest.strip_prefix("super::") {
                depth = depth.saturating_sub(1);
                rest = r;
            }
            if depth != 0 {
                continue; // within the module itself
            }
        } else {
            rest = &rest["crate::".len()..];
        }
        match rest.strip_prefix('{') {
            Some(group) => named.extend(group_heads(group)),
            None => named.push(ident_at(rest).to_string()),
        }
    }
    named
}

/// The store's module graph, read from its sources.
fn store_graph() -> Graph {
    let root = src();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    let rel = |f: &PathBuf| f.strip_prefix(&root).unwrap().to_path_buf();
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|f| module_path(&rel(f)).first().cloned())
        .filter(|m| m != "lib" && m != "main")
        .collect();
    let mut graph: Graph = modules.iter().map(|m| (m.clone(), BTreeMap::new())).collect();
    for file in &files {
        let path = module_path(&rel(file));
        let Some(top) = path.first().filter(|m| modules.contains(*m)) else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            for name in named_modules(line, &path) {
                if modules.contains(&name) && name != *top {
                    let at = format!("src/{}:{}", rel(file).display(), n + 1);
                    graph.get_mut(top).unwrap().entry(name).or_insert(at);
                }
            }
        }
    }
    graph
}

/// The strongly connected components of more than one module (Tarjan).
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Walk<'g> {
        graph: &'g Graph,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        found: Vec<Vec<String>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flat_map(|e| e.keys()) {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.stack.contains(&w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

/// Every module `from` reaches through the graph.
fn reach(graph: &Graph, from: &str) -> BTreeSet<String> {
    let (mut seen, mut todo) = (BTreeSet::new(), vec![from.to_string()]);
    while let Some(m) = todo.pop() {
        for next in graph.get(&m).into_iter().flat_map(|e| e.keys()) {
            if seen.insert(next.clone()) {
                todo.push(next.clone());
            }
        }
    }
    seen
}

/// The edges inside a cycle, each with where it is written.
fn explain(graph: &Graph, cycle: &[String]) -> String {
    let mut lines = Vec::new();
    for from in cycle {
        for (to, at) in &graph[from] {
            if cycle.contains(to) {
                lines.push(format!("  {from} -> {to} ({at})"));
            }
        }
    }
    lines.join("\n")
}

#[test]
fn no_two_of_the_stores_modules_import_each_other() {
    let graph = store_graph();
    assert!(
        graph.contains_key("backend") && graph.contains_key("sqlite"),
        "{graph:?}"
    );
    let found = cycles(&graph);
    let report: Vec<String> = found
        .iter()
        .map(|c| format!("{}:\n{}", c.join(", "), explain(&graph, c)))
        .collect();
    assert!(
        found.is_empty(),
        "modules that import each other:\n{}",
        report.join("\n")
    );
}

#[test]
fn the_modules_below_the_storage_trait_never_reach_it() {
    let graph = store_graph();
    for module in BELOW_THE_TRAIT {
        assert!(graph.contains_key(*module), "no module {module}");
        let reached = reach(&graph, module);
        assert!(
            !reached.contains("backend"),
            "{module} reaches the trait: it imports {reached:?}"
        );
    }
}

#[test]
fn the_reader_sees_groups_climbs_and_cycles() {
    let path = |p: &[&str]| p.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    assert_eq!(
        named_modules("use crate::{a::{b, c}, d, e::f};", &path(&["x"])),
        ["a", "d", "e"]
    );
    assert_eq!(
        named_modules("pub(in crate::sqlite) fn f()", &path(&["sqlite"])),
        ["sqlite"]
    );
    assert_eq!(
        named_modules("use super::super::columns::X;", &path(&["sqlite", "engine"])),
        ["columns"]
    );
    assert!(named_modules("use super::Writer;", &path(&["sqlite", "engine"])).is_empty());
    assert!(named_modules("use idemgate_crate::x;", &path(&["x"])).is_empty());

    let graph: Graph =
        [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]
            .iter()
            .fold(Graph::new(), |mut g, (from, to)| {
                g.entry(from.to_string())
                    .or_default()
                    .insert(to.to_string(), String::new());
                g.entry(to.to_string()).or_default();
                g
            });
    assert_eq!(cycles(&graph), [["a", "b", "c"]]);
    assert!(reach(&graph, "d").is_empty() && reach(&graph, "a").contains("d"));
}
