//! The CHECK constraints a backend's migrations leave in force, read out of
//! the migration files: each statement applied in order to the tables it
//! creates, alters, rebuilds and drops, as the database would.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// What a CHECK admits, or what the code admits, of one column.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Bound {
    /// The value's length in bytes (SQLite's `length` of a text counts
    /// characters; it is used only on ASCII columns, where they are bytes).
    Length { min: u64, max: Option<u64> },
    /// The value itself.
    Value { min: i64, max: Option<i64> },
    /// One of these spellings.
    OneOf(BTreeSet<String>),
}

impl Bound {
    /// Whether every value `inner` admits is admitted by `self`.
    pub(super) fn contains(&self, inner: &Bound) -> bool {
        fn within<T: PartialOrd + Copy>(outer: (T, Option<T>), inner: (T, Option<T>)) -> bool {
            outer.0 <= inner.0
                && match (outer.1, inner.1) {
                    (None, _) => true,
                    (Some(o), Some(i)) => i <= o,
                    (Some(_), None) => false,
                }
        }
        match (self, inner) {
            (Bound::Length { min, max }, Bound::Length { min: i, max: j }) => within((*min, *max), (*i, *j)),
            (Bound::Value { min, max }, Bound::Value { min: i, max: j }) => within((*min, *max), (*i, *j)),
            (Bound::OneOf(outer), Bound::OneOf(inner)) => inner.is_subset(outer),
            _ => false,
        }
    }
}

pub(super) fn one_of<'a>(values: impl IntoIterator<Item = &'a str>) -> Bound {
    Bound::OneOf(values.into_iter().map(str::to_string).collect())
}

/// One CHECK in force.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Check {
    pub(super) column: String,
    /// As PostgreSQL names a column's constraint, or as the migration
    /// names a table's; what `DROP CONSTRAINT` refers to.
    pub(super) name: String,
    pub(super) expr: String,
}

#[derive(Debug, Default)]
pub(super) struct Table {
    pub(super) columns: BTreeSet<String>,
    pub(super) checks: Vec<Check>,
}

/// The SQL of `text` as statements, comments dropped and white space
/// collapsed; `;` inside quotes and `$$` bodies does not end one.
pub(super) fn statements(text: &str) -> Vec<String> {
    let (mut out, mut cur) = (Vec::new(), String::new());
    let (mut quoted, mut dollar) = (false, false);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' if !dollar => quoted = !quoted,
            '$' if !quoted && chars.peek() == Some(&'$') => {
                chars.next();
                dollar = !dollar;
                cur.push_str("$$");
                continue;
            }
            '-' if !quoted && !dollar && chars.peek() == Some(&'-') => {
                while chars.next_if(|c| *c != '\n').is_some() {}
                continue;
            }
            ';' if !quoted && !dollar => {
                out.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    out.push(cur);
    out.iter()
        .map(|s| s.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|s| !s.is_empty())
        .collect()
}

/// The text inside the parenthesis that opens at `open`, and where it closes.
fn group(s: &str, open: usize) -> (&str, usize) {
    let mut depth = 0;
    for (i, c) in s.char_indices().skip_while(|(i, _)| *i < open) {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return (&s[open + 1..i], i);
                }
            }
            _ => {}
        }
    }
    panic!("unbalanced parentheses in {s}")
}

/// `s` split at the commas outside parentheses.
fn split_top(s: &str) -> Vec<&str> {
    let (mut out, mut depth, mut start) = (Vec::new(), 0, 0);
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(s[start..i].trim());
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(s[start..].trim());
    out
}

/// `s` without the leading keywords `prefix` (any case).
fn after<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    s.get(..prefix.len())
        .filter(|head| head.eq_ignore_ascii_case(prefix))
        .map(|_| &s[prefix.len()..])
}

/// The first word of `s`: a name, unquoted (SQLite's stored schema quotes a
/// renamed table's).
fn first_word(s: &str) -> &str {
    s.split([' ', '(']).next().unwrap_or("").trim_matches('"')
}

/// The expression of the `CHECK (...)` in `s`, if it has one.
fn check_expr(s: &str) -> Option<String> {
    let at = s.to_ascii_uppercase().find("CHECK (")?;
    Some(group(s, at + "CHECK ".len()).0.trim().to_string())
}

/// The column a table constraint's expression bounds: the first of the
/// table's columns it names.
fn column_in(expr: &str, table: &Table) -> String {
    expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .find(|w| table.columns.contains(*w))
        .unwrap_or_else(|| panic!("no column of the table in CHECK ({expr})"))
        .to_string()
}

impl Table {
    /// A column definition (`name TYPE ... [CHECK (...)]`) of `table`.
    fn add_column(&mut self, table: &str, def: &str) {
        let column = first_word(def).to_string();
        if let Some(expr) = check_expr(def) {
            self.checks.push(Check {
                name: format!("{table}_{column}_check"),
                column: column.clone(),
                expr,
            });
        }
        self.columns.insert(column);
    }

    fn add_constraint(&mut self, name: String, def: &str) {
        if let Some(expr) = check_expr(def) {
            let column = column_in(&expr, self);
            self.checks.push(Check { column, name, expr });
        }
    }
}

/// The tables, with their CHECKs, that the migrations of `backend` leave.
pub(super) fn in_force(backend: &str) -> BTreeMap<String, Table> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("src")
        .join(backend)
        .join("migrations");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no migrations in {}", dir.display());
    let mut tables: BTreeMap<String, Table> = BTreeMap::new();
    for file in files {
        for stmt in statements(&std::fs::read_to_string(&file).unwrap()) {
            apply(&mut tables, &stmt);
        }
    }
    tables
}

/// What `stmt` does to the tables' columns and CHECKs. A statement that
/// could change a CHECK and is not understood here fails the test, so a
/// new kind of migration cannot slip past it.
pub(super) fn apply(tables: &mut BTreeMap<String, Table>, stmt: &str) {
    if let Some(rest) = after(stmt, "CREATE TABLE ") {
        let (keep, rest) = match after(rest, "IF NOT EXISTS ") {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        let name = first_word(rest).to_string();
        if keep && tables.contains_key(&name) {
            return;
        }
        let open = rest.find('(').unwrap();
        let mut table = Table::default();
        let mut constraints = Vec::new();
        for item in split_top(group(rest, open).0) {
            match first_word(item).to_ascii_uppercase().as_str() {
                "PRIMARY" | "UNIQUE" | "FOREIGN" | "CHECK" | "CONSTRAINT" => constraints.push(item),
                _ => table.add_column(&name, item),
            }
        }
        for (i, item) in constraints.into_iter().enumerate() {
            let named = after(item, "CONSTRAINT ").map(first_word);
            table.add_constraint(
                named.map_or_else(|| format!("{name}_check{i}"), str::to_string),
                item,
            );
        }
        tables.insert(name, table);
    } else if let Some(rest) = after(stmt, "DROP TABLE ") {
        let rest = after(rest, "IF EXISTS ").unwrap_or(rest);
        tables.remove(first_word(rest));
    } else if let Some(rest) = after(stmt, "ALTER TABLE ") {
        let rest = after(rest, "IF EXISTS ").unwrap_or(rest);
        let name = first_word(rest).to_string();
        let action = rest[name.len()..].trim();
        if let Some(new) = after(action, "RENAME TO ") {
            let table = tables.remove(&name).unwrap();
            tables.insert(first_word(new).to_string(), table);
            return;
        }
        let table = tables
            .get_mut(&name)
            .unwrap_or_else(|| panic!("{stmt}: no table {name}"));
        if let Some(def) = after(action, "ADD COLUMN ") {
            match after(def, "IF NOT EXISTS ") {
                Some(def) if table.columns.contains(first_word(def)) => {}
                Some(def) => table.add_column(&name, def),
                None => table.add_column(&name, def),
            }
        } else if let Some(def) = after(action, "ADD CONSTRAINT ") {
            table.add_constraint(first_word(def).to_string(), def);
        } else if let Some(rest) = after(action, "DROP CONSTRAINT ") {
            let rest = after(rest, "IF EXISTS ").unwrap_or(rest);
            table.checks.retain(|c| c.name != first_word(rest));
        } else if let Some(rest) = after(action, "DROP COLUMN ") {
            let column = first_word(after(rest, "IF EXISTS ").unwrap_or(rest));
            table.checks.retain(|c| c.column != column);
            table.columns.remove(column);
        } else if after(action, "ALTER COLUMN ").is_some_and(|a| !a.to_ascii_uppercase().contains("CHECK")) {
            // NOT NULL, a default or a type: no CHECK changes.
        } else {
            panic!("a migration statement this test does not understand: {stmt}");
        }
    } else if stmt.to_ascii_uppercase().contains("CHECK") {
        panic!("a migration statement this test does not understand: {stmt}");
    }
}

/// What the CHECK `expr` on `column` admits. Its forms: `[column IS NULL OR]`
/// then `column IN (...)`, or a length (`length(...)`, `octet_length(...)`)
/// or the column, followed by `BETWEEN a AND b`, `= n`, `<= n`, `>= n` or
/// `> n`.
pub(super) fn bound(column: &str, expr: &str) -> Bound {
    let e = expr
        .strip_prefix(&format!("{column} IS NULL OR "))
        .unwrap_or(expr)
        .trim();
    if let Some(list) = e.strip_prefix(&format!("{column} IN (")) {
        let list = list.strip_suffix(')').unwrap();
        return one_of(list.split(',').map(|v| v.trim().trim_matches('\'')));
    }
    let (length, op) = if e.starts_with("length(") || e.starts_with("octet_length(") {
        let (inner, close) = group(e, e.find('(').unwrap());
        assert!(inner.split(['(', ' ', ')']).any(|w| w == column), "{expr}");
        (true, e[close + 1..].trim())
    } else {
        let op = e
            .strip_prefix(column)
            .unwrap_or_else(|| panic!("CHECK ({expr}) of {column}"));
        (false, op.trim())
    };
    let n = |s: &str| {
        s.trim()
            .parse::<i64>()
            .unwrap_or_else(|_| panic!("CHECK ({expr}): {s}"))
    };
    let (min, max) = if let Some(range) = after(op, "BETWEEN ") {
        let (a, b) = range.split_once(" AND ").unwrap();
        (n(a), Some(n(b)))
    } else if let Some(v) = op.strip_prefix("<=") {
        (0, Some(n(v)))
    } else if let Some(v) = op.strip_prefix(">=") {
        (n(v), None)
    } else if let Some(v) = op.strip_prefix('>') {
        (n(v) + 1, None)
    } else if let Some(v) = op.strip_prefix('=') {
        (n(v), Some(n(v)))
    } else {
        panic!("CHECK ({expr}) of {column}: a form this test does not read")
    };
    if length {
        let len = |v: i64| u64::try_from(v).unwrap();
        Bound::Length {
            min: len(min),
            max: max.map(len),
        }
    } else {
        Bound::Value { min, max }
    }
}
