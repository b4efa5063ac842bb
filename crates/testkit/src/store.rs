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

/// `bin ARGS --database-url database_url` run to its end, as an operator
/// runs a command: without the tests' `IDEMGATE_MIGRATE` and without a
/// database URL or pooler from the environment, so that only `args` decide.
/// Whether it succeeded, its standard output and its standard error.
pub fn run(bin: &Path, database_url: &str, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin)
        .env_remove("IDEMGATE_MIGRATE")
        .env_remove("IDEMGATE_DATABASE_URL")
        .env_remove("IDEMGATE_PG_POOLER")
        .args(["--database-url", database_url])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", bin.display()));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
