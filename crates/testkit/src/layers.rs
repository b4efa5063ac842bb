//! A crate's module graph, read from its sources, for the tests that keep a
//! crate's modules in layers (`crates/core/tests/layers.rs`,
//! `crates/store/tests/layers.rs`): a cycle is where a low module (a word of
//! the lexicon, the error type) starts depending on what is built on it.
//! The same tests keep each crate's root a guide with one line per module
//! ([`assert_the_guide_names_every_module`]).
//!
//! Every file under `src/` is a node named by its module path
//! (`exchange::head`, `sqlite::engine::writer`, a folder's `mod.rs` by the
//! folder: `exchange`; the crate root `crate`). Test code is left out, since
//! tests may reach anything: `tests.rs`, `tests/` folders, a file that opens
//! with `#![cfg(test)]`, and every item under `#[cfg(test)]`; so is a
//! binary's root (`main.rs`, `bin/`), which is a crate of its own.
//!
//! A file names another when a `crate::` or `super::` path in its code
//! leads there, to the deepest module the path spells:
//! `crate::exchange::head::RequestHead` names `exchange::head`,
//! `crate::exchange::Exchange` names `exchange`. Comments and literals are
//! not code. A folder's `mod.rs` naming its own files by their bare names
//! (`mod raw;`, `pub use step::Step;`) is no edge, or every file reaching
//! up to its folder's `mod.rs` would be a cycle; [`folders`] reads a folder
//! as one node instead, which sees a cycle through a folder's front door.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Module to the modules it names, each with the first place it does
/// (`src/exchange/mod.rs:14`).
pub type Graph = BTreeMap<String, BTreeMap<String, String>>;

/// Checks that the crate root under `src` is the crate's guide, as
/// mini-redis's `lib.rs` is: every top-level module of `src/` (a file or a
/// folder) is declared there, and the line above each declaration is a
/// `// ` comment saying what it holds.
pub fn assert_the_guide_names_every_module(src: &Path) {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let lines: Vec<&str> = lib.lines().collect();
    let mut declared: Vec<String> = lines
        .iter()
        .enumerate()
        .filter_map(|(i, line)| {
            let name = line
                .strip_prefix("pub mod ")
                .or_else(|| line.strip_prefix("mod "))?;
            let name = name.strip_suffix(';')?;
            let said = i > 0 && lines[i - 1].starts_with("// ");
            assert!(said, "lib.rs: `{line}` has no line saying what it holds");
            Some(name.to_string())
        })
        .collect();
    let mut on_disk: Vec<String> = std::fs::read_dir(src)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let name = path.file_stem()?.to_str()?.to_string();
            (name != "lib" && name != "main" && (path.is_dir() || path.extension()? == "rs")).then_some(name)
        })
        .collect();
    on_disk.sort();
    on_disk.dedup();
    declared.sort();
    assert_eq!(declared, on_disk, "lib.rs's modules and src/'s files differ");
}

/// The graph of the crate whose sources are under `src`.
pub fn read(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, true, &mut files);
    let rel = |f: &PathBuf| f.strip_prefix(src).unwrap().to_path_buf();
    let modules: BTreeSet<Vec<String>> = files.iter().map(|f| module_path(&rel(f))).collect();
    let mut graph = Graph::new();
    for file in &files {
        let code = code(&std::fs::read_to_string(file).unwrap());
        if code.trim_start().starts_with("#![cfg(test)]") {
            continue;
        }
        let module = module_path(&rel(file));
        let name = node(&module);
        refuse_climbs_in_inline_modules(&code, file);
        let edges = graph.entry(name.clone()).or_default();
        for (at, path) in paths(&code, &module) {
            let to = (0..=path.len())
                .rev()
                .map(|n| &path[..n])
                .find(|prefix| modules.contains(*prefix))
                .map(node)
                .unwrap_or_else(|| node(&[]));
            if to != name {
                let line = code[..at].matches('\n').count() + 1;
                edges
                    .entry(to)
                    .or_insert_with(|| format!("src/{}:{line}", rel(file).display()));
            }
        }
    }
    graph
}

/// The paths from the crate root that `code` (Rust source) names through
/// `crate::` and `super::`, seen from `module`; `use super::{a, b::c}` in
/// `x::y` names `x::a` and `x::b::c`.
pub fn named(code_text: &str, module: &[&str]) -> Vec<Vec<String>> {
    let module: Vec<String> = module.iter().map(|s| s.to_string()).collect();
    paths(&code(code_text), &module)
        .into_iter()
        .map(|(_, path)| path)
        .collect()
}

/// `graph` with each folder one node (`sqlite::engine` is `sqlite`), and
/// the edges inside a folder left out.
pub fn folders(graph: &Graph) -> Graph {
    let top = |name: &str| name.split("::").next().unwrap_or(name).to_string();
    let mut folded = Graph::new();
    for (from, edges) in graph {
        let entry = folded.entry(top(from)).or_default();
        for (to, at) in edges {
            if top(to) != top(from) {
                entry.entry(top(to)).or_insert_with(|| at.clone());
            }
        }
    }
    folded
}

/// The strongly connected components of more than one module (Tarjan's):
/// each is a set of modules every one of which leads back to itself
/// through the others.
pub fn cycles(graph: &Graph) -> Vec<Vec<String>> {
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
    walk.found.sort();
    walk.found
}

/// Every module `from` leads to.
pub fn reach(graph: &Graph, from: &str) -> BTreeSet<String> {
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

/// Fails when `graph` has a cycle, naming each with the lines that close
/// it; `nodes` says what the graph's nodes are ("files", "modules").
pub fn assert_no_cycle(graph: &Graph, nodes: &str) {
    let found = cycles(graph);
    assert!(
        found.is_empty(),
        "{nodes} that lead back to themselves:\n{}",
        describe(graph, &found)
    );
}

/// Each cycle with its edges and where each is written, for a failure.
pub fn describe(graph: &Graph, cycles: &[Vec<String>]) -> String {
    let mut out = Vec::new();
    for cycle in cycles {
        out.push(format!("{}:", cycle.join(", ")));
        for from in cycle {
            for (to, at) in &graph[from] {
                if cycle.contains(to) {
                    out.push(format!("  {from} -> {to} ({at})"));
                }
            }
        }
    }
    out.join("\n")
}

fn rust_files(dir: &Path, root: bool, into: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if path.is_dir() {
            if name != "tests" && !(root && name == "bin") {
                rust_files(&path, false, into);
            }
        } else if name.ends_with(".rs") && name != "tests.rs" && !(root && name == "main.rs") {
            into.push(path);
        }
    }
}

/// `exchange/head.rs` is `[exchange, head]`, `exchange/mod.rs` is
/// `[exchange]`, `lib.rs` is `[]`.
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if !(stem == "mod" || (parts.is_empty() && stem == "lib")) {
        parts.push(stem.to_string());
    }
    parts
}

fn node(module: &[String]) -> String {
    if module.is_empty() {
        "crate".to_string()
    } else {
        module.join("::")
    }
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// `text` with its comments, string and character literals and
/// `#[cfg(test)]` items blanked out, lines kept where they were.
fn code(text: &str) -> String {
    let mut s: Vec<char> = text.chars().collect();
    let blank = |s: &mut [char], from: usize, to: usize| {
        let to = to.min(s.len());
        for c in &mut s[from..to] {
            if *c != '\n' {
                *c = ' ';
            }
        }
    };
    let starts =
        |s: &[char], i: usize, word: &str| word.chars().enumerate().all(|(k, c)| s.get(i + k) == Some(&c));
    let mut i = 0;
    while i < s.len() {
        let c = s[i];
        // `r"…"` and `br"…"` are raw strings, `for"` or `bar"` are not.
        let raw_may_start = match i {
            0 => true,
            1 => !is_ident(s[0]) || s[0] == 'b',
            _ => !is_ident(s[i - 1]) || (s[i - 1] == 'b' && !is_ident(s[i - 2])),
        };
        let end = if starts(&s, i, "//") {
            (i..s.len()).find(|&j| s[j] == '\n').unwrap_or(s.len())
        } else if starts(&s, i, "/*") {
            let (mut depth, mut j) = (0usize, i);
            while j < s.len() {
                if starts(&s, j, "/*") {
                    depth += 1;
                    j += 2;
                } else if starts(&s, j, "*/") {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            j
        } else if c == 'r' && raw_may_start && matches!(s.get(i + 1), Some('"' | '#')) {
            let hashes = s[i + 1..].iter().take_while(|&&c| c == '#').count();
            if s.get(i + 1 + hashes) != Some(&'"') {
                i += 1;
                continue;
            }
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            let from = i + 2 + hashes;
            (from..s.len())
                .find(|&j| starts(&s, j, &close))
                .map_or(s.len(), |j| j + close.len())
        } else if c == '"' {
            let mut j = i + 1;
            while j < s.len() && s[j] != '"' {
                j += if s[j] == '\\' { 2 } else { 1 };
            }
            j + 1
        } else if c == '\'' && s.get(i + 1) == Some(&'\\') {
            (i + 3..s.len())
                .find(|&j| s[j] == '\'')
                .map_or(s.len(), |j| j + 1)
        } else if c == '\'' && s.get(i + 2) == Some(&'\'') {
            i + 3
        } else {
            i += 1;
            continue;
        };
        blank(&mut s, i, end);
        i = end;
    }
    // Test items, once no brace of a literal can mislead the count.
    let attribute: Vec<char> = "#[cfg(test)]".chars().collect();
    let mut i = 0;
    while i + attribute.len() <= s.len() {
        if s[i..i + attribute.len()] != attribute[..] {
            i += 1;
            continue;
        }
        let (mut j, mut depth) = (i + attribute.len(), 0i32);
        while j < s.len() {
            match s[j] {
                '(' | '[' => depth += 1,
                ')' | ']' => depth -= 1,
                ';' if depth == 0 => break,
                '{' if depth == 0 => {
                    j = matching_brace(&s, j);
                    break;
                }
                _ => {}
            }
            j += 1;
        }
        blank(&mut s, i, j + 1);
        i = j + 1;
    }
    s.into_iter().collect()
}

/// Where the brace that closes the one at `open` is.
fn matching_brace(s: &[char], open: usize) -> usize {
    let mut depth = 0usize;
    for (j, &c) in s.iter().enumerate().skip(open) {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return j;
                }
            }
            _ => {}
        }
    }
    s.len()
}

/// A `super::` inside an inline module (`mod codes { use super::X; }`)
/// climbs from that module, not from its file; this reader reads it as its
/// file's, so it refuses to read one wrong.
fn refuse_climbs_in_inline_modules(code: &str, file: &Path) {
    let s: Vec<char> = code.chars().collect();
    let mut i = 0;
    while let Some(at) = (i..s.len().saturating_sub(3))
        .find(|&j| s[j..j + 4] == ['m', 'o', 'd', ' '] && (j == 0 || !is_ident(s[j - 1])))
    {
        let mut j = at + 4;
        while j < s.len() && (is_ident(s[j]) || s[j].is_whitespace()) {
            j += 1;
        }
        if s.get(j) == Some(&'{') {
            let body: String = s[j..matching_brace(&s, j)].iter().collect();
            assert!(
                !body.contains("super::"),
                "{}: an inline module climbs with super::, which the layers reader does not follow",
                file.display()
            );
        }
        i = j;
    }
}

/// Each `crate::` or `super::` path in `code`, from the crate root, with
/// where it starts.
fn paths(code: &str, module: &[String]) -> Vec<(usize, Vec<String>)> {
    let s: Vec<char> = code.chars().collect();
    let byte_at: Vec<usize> = code.char_indices().map(|(b, _)| b).collect();
    let mut found = Vec::new();
    for i in 0..s.len() {
        if i > 0 && (is_ident(s[i - 1]) || s[i - 1] == ':') {
            continue; // `x::crate::`, or a later `super::` of one chain
        }
        let starts = |at: usize, word: &str| word.chars().enumerate().all(|(k, c)| s.get(at + k) == Some(&c));
        let (base, p) = if starts(i, "crate::") {
            (Some(Vec::new()), i + "crate::".len())
        } else if starts(i, "super::") {
            let mut base = Some(module.to_vec());
            let mut p = i;
            while starts(p, "super::") {
                base = base.and_then(|mut b| b.pop().map(|_| b));
                p += "super::".len();
            }
            (base, p)
        } else {
            continue;
        };
        let Some(base) = base else {
            continue; // above the crate root
        };
        for path in use_tree(&s, p).0 {
            found.push((byte_at[i], base.iter().cloned().chain(path).collect()));
        }
    }
    found
}

/// The paths a use tree starting at `p` spells (`a::{b, c::d}`: `a::b`,
/// `a::c::d`), and where it ends. A path ends where `::` does not follow a
/// name, so `Letter {` of a struct literal is no group.
fn use_tree(s: &[char], mut p: usize) -> (Vec<Vec<String>>, usize) {
    let mut prefix = Vec::new();
    loop {
        if s.get(p) == Some(&'{') {
            p += 1;
            let mut paths = Vec::new();
            loop {
                while s.get(p).is_some_and(|c| c.is_whitespace()) {
                    p += 1;
                }
                match s.get(p) {
                    None => break,
                    Some('}') => {
                        p += 1;
                        break;
                    }
                    _ => {}
                }
                let (inner, end) = use_tree(s, p);
                paths.extend(inner.into_iter().map(|tail| [prefix.clone(), tail].concat()));
                p = end;
                // Past what follows an item (`as Name`) to the next one.
                while s.get(p).is_some_and(|&c| c != ',' && c != '}') {
                    p += 1;
                }
                if s.get(p) == Some(&',') {
                    p += 1;
                }
            }
            return (paths, p);
        }
        let len = s[p.min(s.len())..]
            .iter()
            .take_while(|&&c| is_ident(c) || c == '*')
            .count();
        if len == 0 {
            return (vec![prefix], p);
        }
        prefix.push(s[p..p + len].iter().collect());
        p += len;
        if s.get(p) == Some(&':') && s.get(p + 1) == Some(&':') {
            p += 2;
        } else {
            return (vec![prefix], p);
        }
    }
}
