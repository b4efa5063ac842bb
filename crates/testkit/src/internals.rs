//! What must never reach a client: markers of SQL, database names, paths,
//! source locations and panics in an answer's body. One list, used by the
//! chaos audit, the security tests and the fuzz oracle.

/// Markers of internals that must never appear in an error a client gets.
pub const INTERNALS: [&str; 13] = [
    "SELECT ",
    "INSERT ",
    "UPDATE ",
    "sqlite",
    "SQLite",
    "SQLITE",
    "postgres",
    "/tmp/",
    "/home/",
    "/root/",
    ".rs:",
    "panicked",
    "backtrace",
];

/// The first marker of [`INTERNALS`] that `text` contains.
pub fn shown_in(text: &str) -> Option<&'static str> {
    INTERNALS.iter().copied().find(|m| text.contains(m))
}
