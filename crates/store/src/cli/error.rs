//! Why a command failed, in words for the operator who ran it.

use std::path::PathBuf;

use crate::backend::StoreError;

/// A command's failure. `Display` is the message the operator sees (after
/// `idempotency-store: `); the wrapped store or I/O error, if any, is its
/// [`source`](std::error::Error::source).
#[derive(Debug)]
pub enum CliError {
    /// A required value was given neither as a flag, a file nor in the
    /// environment (`what`: "api token", "admin token", ...).
    Missing { what: &'static str },
    /// The value was given, but empty.
    Empty { what: &'static str },
    /// A file a flag names could not be read.
    Read {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    /// A value is unusable, or two values contradict each other; the
    /// message names the flag.
    Invalid(String),
    /// The database refused or failed.
    Store(StoreError),
    /// A change named a record that is not there, or not in a state the
    /// change applies to (`what`: the records it applies to).
    NoRecord { what: &'static str },
    /// An address could not be listened on.
    Listen { addr: String, source: std::io::Error },
    /// Serving stopped on an I/O error.
    Serve(std::io::Error),
    /// The result could not be written out as JSON.
    Output(serde_json::Error),
    /// A sweep finished, but batches of some phase failed and were rolled
    /// back (how many); the log says why.
    SweepIncomplete { failed: u64 },
}

impl CliError {
    /// [`CliError::Invalid`] of a message naming `--flag`.
    pub fn flag(flag: &str, reason: impl std::fmt::Display) -> CliError {
        CliError::Invalid(format!("--{flag}: {reason}"))
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Missing { what } => {
                let flag = what.replace(' ', "-");
                let var = what.replace(' ', "_").to_uppercase();
                write!(
                    f,
                    "no {what}: pass --{flag} or --{flag}-file, or set IDEMGATE_{var}"
                )
            }
            CliError::Empty { what } => write!(f, "the {what} is empty"),
            CliError::Read { what, path, source } => {
                write!(f, "cannot read the {what} file {}: {source}", path.display())
            }
            CliError::Invalid(message) => f.write_str(message),
            CliError::Store(e) => write!(f, "{e}"),
            CliError::NoRecord { what } => write!(f, "no {what} with this scope"),
            CliError::Listen { addr, source } => write!(f, "cannot listen on {addr}: {source}"),
            CliError::Serve(e) => write!(f, "{e}"),
            CliError::Output(e) => write!(f, "{e}"),
            CliError::SweepIncomplete { failed } => write!(
                f,
                "{failed} batches of a sweeper phase failed and were rolled back (the log says why); \
                 the other phases were swept"
            ),
        }
    }
}

impl std::error::Error for CliError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            CliError::Read { source, .. } | CliError::Listen { source, .. } => Some(source),
            CliError::Serve(e) => Some(e),
            CliError::Store(e) => Some(e),
            CliError::Output(e) => Some(e),
            CliError::Missing { .. } | CliError::Empty { .. } | CliError::Invalid(_) => None,
            CliError::NoRecord { .. } | CliError::SweepIncomplete { .. } => None,
        }
    }
}

impl From<StoreError> for CliError {
    fn from(e: StoreError) -> CliError {
        CliError::Store(e)
    }
}
