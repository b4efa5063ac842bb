use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let mut filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into());
    // The PostgreSQL driver logs statement parameters (raw keys, stored
    // bodies) at debug: never let it, whatever RUST_LOG says.
    if let Ok(cap) = "tokio_postgres=info".parse() {
        filter = filter.add_directive(cap);
    }
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = idemgate_store::cli::Cli::parse();
    match idemgate_store::cli::execute(cli).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idempotency-store: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
