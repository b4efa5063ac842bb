use clap::Parser;
use idemgate_store::cli::{Cli, LogFormat};

#[tokio::main]
async fn main() -> std::process::ExitCode {
    // Parsed first: the command line says how to log.
    let cli = Cli::parse();
    let format = cli.log_format();
    init_logging(format);
    match idemgate_store::cli::execute(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            match format {
                LogFormat::Text => eprintln!("idempotency-store: {e}"),
                // Every line on stderr parses, the last one included.
                LogFormat::Json => eprintln!(
                    "{}",
                    serde_json::json!({
                        "level": "ERROR",
                        "target": "idempotency_store",
                        "message": e.to_string(),
                    })
                ),
            }
            std::process::ExitCode::FAILURE
        }
    }
}

fn init_logging(format: LogFormat) {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // The PostgreSQL driver logs statement parameters (raw keys, stored
    // bodies) at debug: never let it, whatever RUST_LOG says.
    if let Ok(cap) = "tokio_postgres=info".parse() {
        filter = filter.add_directive(cap);
    }
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        // The event's fields at the top level, next to level, target and
        // timestamp, so a pipeline indexes `event`, `record`, ... directly.
        // The store's lines carry everything in their fields, not in spans.
        LogFormat::Json => logs
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

// glibc's malloc was about a tenth of the store's CPU at 32 connections;
// mimalloc for Rust's allocations takes 5–6% off a new key's store CPU
// there, mostly through its huge pages: about 11 MiB more resident memory,
// which MIMALLOC_ARENA_EAGER_COMMIT=0 gives back (profile.md §22). SQLite
// keeps glibc's: with `override`, a store under an LD_PRELOADed library that
// allocates in its constructor (faketime) hangs at start.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
