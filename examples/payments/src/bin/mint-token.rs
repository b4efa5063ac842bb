//! Prints a demo token for any tenant and subject:
//!
//! ```sh
//! examples/mint-token --tenant tenant-c --sub carol
//! examples/mint-token --jwks      # the public key, as envoy/demo.yaml has it
//! ```
//!
//! The signing key is the demo-only key in examples/keys/: never trust it anywhere else.

use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use payments::token;

#[derive(Parser)]
#[command(
    name = "mint-token",
    about = "Mint an ES256 token with the DEMO-ONLY key for envoy/demo.yaml"
)]
struct Args {
    /// The `tenant` claim (becomes the idempotency scope's tenant).
    #[arg(long, required_unless_present = "jwks")]
    tenant: Option<String>,
    /// The `sub` claim (becomes the scope's principal).
    #[arg(long, required_unless_present = "jwks")]
    sub: Option<String>,
    /// Seconds until the token expires (default: 2100-01-01).
    #[arg(long)]
    expires_in: Option<u64>,
    /// Print the public key as a JWKS document instead.
    #[arg(long, conflicts_with_all = ["tenant", "sub", "expires_in"])]
    jwks: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let key = match token::demo_key() {
        Ok(key) => key,
        Err(e) => {
            eprintln!("mint-token: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.jwks {
        println!("{}", token::jwks(&key));
        return ExitCode::SUCCESS;
    }
    let (tenant, sub) = (args.tenant.unwrap_or_default(), args.sub.unwrap_or_default());
    if tenant.is_empty() || sub.is_empty() {
        eprintln!("mint-token: --tenant and --sub must not be empty");
        return ExitCode::FAILURE;
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let expires_at = args
        .expires_in
        .map_or(token::FAR_FUTURE, |s| now.saturating_add(s));
    println!("{}", token::mint(&key, &tenant, &sub, now, expires_at));
    ExitCode::SUCCESS
}
