//! The demo upstream: `payments --listen 127.0.0.1:8080` (or `PAYMENTS_LISTEN`).

use std::process::ExitCode;

use clap::Parser;
use payments::{serve, Ledger, DEFAULT_LISTEN};

#[derive(Parser)]
#[command(
    name = "payments",
    about = "Demo upstream for idemgate: counts its executions per tenant"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "PAYMENTS_LISTEN", default_value = DEFAULT_LISTEN)]
    listen: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let listener = match tokio::net::TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            eprintln!("payments: cannot listen on {}: {e}", args.listen);
            return ExitCode::FAILURE;
        }
    };
    println!("payments: listening on http://{}", args.listen);
    match serve(listener, Ledger::default(), shutdown()).await {
        Ok(()) => {
            println!("payments: stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("payments: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Ctrl-C or SIGTERM.
async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}
