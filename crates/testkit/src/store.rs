//! The store binary's command line as the tests run it.

use std::path::Path;
use std::process::Command;

/// `idempotency-store serve` on `127.0.0.1:port` with this database and these
/// credentials, logging at `rust_log`. It migrates the schema first
/// (`IDEMGATE_MIGRATE`, which a store from before that setting ignores): a
/// test's throwaway database has no owner running `migrate` ahead of it.
pub fn serve(
    bin: &Path,
    port: u16,
    database_url: &str,
    api_token: &str,
    admin_token: &str,
    rust_log: &str,
) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("serve")
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .args(["--database-url", database_url])
        .args(["--api-token", api_token, "--admin-token", admin_token])
        .env("IDEMGATE_MIGRATE", "true")
        .env("RUST_LOG", rust_log);
    cmd
}
