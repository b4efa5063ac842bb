//! PostgreSQL roles as docs/operations.md sets them up: the schema's owner
//! runs `migrate` (the only command that issues DDL), the store serves as
//! an application role that may only read and write rows, and operators
//! inspect as a read-only role, which changes nothing.

use std::path::Path;

use idemgate_core::protocol::ClaimReply;

use crate::support::*;

const OWNER: &str = "idemgate_owner";
const APP: &str = "idemgate_app";
const READER: &str = "idemgate_readonly";
const DB: &str = "idemgate";

/// A cluster with the three roles and their database, set up as
/// docs/operations.md#roles-and-migrations says (grants given ahead of the
/// tables, as default privileges of the owner).
fn cluster_with_roles() -> pg::PgCluster {
    let cluster = pg::PgCluster::start();
    cluster.query(&format!(
        "CREATE ROLE {OWNER} LOGIN; CREATE ROLE {APP} LOGIN; CREATE ROLE {READER} LOGIN"
    ));
    cluster.query(&format!("CREATE DATABASE {DB} OWNER {OWNER}"));
    cluster.query_in(
        DB,
        &format!(
            "REVOKE ALL ON DATABASE {DB} FROM PUBLIC; REVOKE CREATE ON SCHEMA public FROM PUBLIC; \
             GRANT CONNECT ON DATABASE {DB} TO {APP}, {READER}; \
             GRANT USAGE ON SCHEMA public TO {APP}, {READER}; \
             ALTER DEFAULT PRIVILEGES FOR ROLE {OWNER} IN SCHEMA public \
               GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO {APP}; \
             ALTER DEFAULT PRIVILEGES FOR ROLE {OWNER} IN SCHEMA public \
               GRANT USAGE, SELECT ON SEQUENCES TO {APP}; \
             ALTER DEFAULT PRIVILEGES FOR ROLE {OWNER} IN SCHEMA public GRANT SELECT ON TABLES TO {READER}"
        ),
    );
    cluster
}

/// `idempotency-store ARGS` on `url`, as an operator runs it: success,
/// standard output, standard error.
fn store(url: &str, args: &[&str]) -> (bool, String, String) {
    idemgate_testkit::store::run(Path::new(env!("CARGO_BIN_EXE_idempotency-store")), url, args)
}

/// The schema's objects and the records' contents.
fn contents(cluster: &pg::PgCluster) -> String {
    cluster.query_in(
        DB,
        "SELECT (SELECT string_agg(relname || ':' || relkind::text, ',' ORDER BY relname) FROM pg_class c \
           JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public') || ' ' || \
         (SELECT md5(string_agg(r::text, ',' ORDER BY r::text)) FROM idempotency_records r) || ' ' || \
         (SELECT count(*) FROM idempotency_events)",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_owner_migrates_the_app_serves_and_a_reader_inspects_without_writing() {
    let cluster = cluster_with_roles();
    let (owner, app, reader) = (
        cluster.url_as(OWNER, DB),
        cluster.url_as(APP, DB),
        cluster.url_as(READER, DB),
    );

    // Before `migrate`, nothing starts: the schema is not there, and no
    // command but `migrate` creates it.
    let err = serve_refused(&app, &[]);
    assert!(
        err.contains("schema is not created") && err.contains("idempotency-store migrate"),
        "{err}"
    );
    let (ok, _, err) = store(&reader, &["inspect", "--unknown"]);
    assert!(!ok && err.contains("idempotency-store migrate"), "{err}");
    assert_eq!(
        cluster.query_in(
            DB,
            "SELECT count(*) FROM pg_class WHERE relname LIKE 'idempotency%'"
        ),
        "0",
        "a refused command created something"
    );
    // The app role cannot migrate, even when asked to.
    let (ok, _, err) = store(&app, &["migrate"]);
    assert!(!ok && err.contains("permission denied"), "{err}");

    let (ok, _, err) = store(&owner, &["migrate"]);
    assert!(ok, "migrate as the owner: {err}");
    assert_eq!(
        cluster.query_in(DB, "SELECT max(version) FROM idempotency_schema_migrations"),
        idemgate_store::postgres::LATEST_SCHEMA.to_string()
    );
    // Again: the schema is current, so even the app role's `migrate`
    // passes, and nothing is written (but the fence sequence, which every
    // new connection moves up to the clock).
    let before = contents(&cluster);
    let (ok, _, err) = store(&app, &["migrate"]);
    assert!(ok, "migrate again: {err}");
    assert_eq!(contents(&cluster), before, "a second migrate wrote");

    // The app role holds no DDL right, and serves.
    assert_eq!(
        cluster.query_in(
            DB,
            &format!(
                "SELECT has_schema_privilege('{APP}', 'public', 'CREATE') || ' ' || \
                 has_table_privilege('{APP}', 'idempotency_records', 'TRUNCATE') || ' ' || \
                 has_table_privilege('{APP}', 'idempotency_records', 'INSERT')"
            )
        ),
        "false false true"
    );
    let mut served = StoreProcess::start_with(&app, "warn", |cmd| {
        cmd.env_remove("IDEMGATE_MIGRATE");
    })
    .await;
    let c = client();
    let ready = request(&c, "GET", &served.url("/readyz"), None, Vec::new()).await;
    assert_eq!(ready.status, 200);
    let s = scope("k-roles");
    let (reply, _) = claim_over_http(&c, &served, &claim(&s, Some(1))).await;
    let ClaimReply::Owned { fence } = reply else {
        panic!("expected Owned, got {reply:?}");
    };
    let (status, _) = http_complete(&c, &served, &s, fence, b"{\"charged\":true}").await;
    assert_eq!(status, 200, "{}", served.log());
    let (replayed, body) = claim_over_http(&c, &served, &claim(&s, Some(1))).await;
    assert!(matches!(replayed, ClaimReply::Replay { .. }), "{replayed:?}");
    assert_eq!(body, b"{\"charged\":true}");
    assert!(!served.log().contains("ERROR"), "{}", served.log());
    served.kill9();

    // Inspecting writes nothing, as the read-only role and as the owner,
    // who could: the commands' transactions are read-only.
    let before = (cluster.next_xid(), contents(&cluster));
    for url in [&reader, &owner] {
        let (ok, out, err) = store(url, &["inspect", "--tenant", "acme", "--key", "k-roles"]);
        assert!(ok, "inspect: {err}");
        let history: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(history["records"][0]["state"], "completed", "{out}");
        let (ok, out, err) = store(url, &["inspect", "--unknown"]);
        assert!(ok && out.trim() == "[]", "inspect --unknown: {out} {err}");
    }
    assert_eq!((cluster.next_xid(), contents(&cluster)), before, "inspect wrote");
    // The read-only role cannot change records through the other commands.
    let (ok, _, err) = store(&reader, &["sweep"]);
    assert!(!ok && err.contains("permission denied"), "{err}");
}

/// A store upgraded ahead of its database refuses to serve until the owner
/// migrates: the message says what to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_behind_the_store_is_refused_until_migrated() {
    let cluster = cluster_with_roles();
    let (owner, app) = (cluster.url_as(OWNER, DB), cluster.url_as(APP, DB));
    let (ok, _, err) = store(&owner, &["migrate"]);
    assert!(ok, "{err}");
    // As if the last migration had not run yet.
    cluster.query_in(
        DB,
        &format!(
            "DELETE FROM idempotency_schema_migrations WHERE version = {}",
            idemgate_store::postgres::LATEST_SCHEMA
        ),
    );
    // The version before the last that PostgreSQL has (SQLite's own are skipped).
    let behind = 6;
    for flags in [&[][..], &["--no-migrate".as_ref()][..]] {
        let err = serve_refused(&app, flags);
        assert!(
            err.contains(&format!("schema is at version {behind}"))
                && err.contains("idempotency-store migrate"),
            "{flags:?}: {err}"
        );
    }
    let (ok, _, err) = store(&app, &["sweep"]);
    assert!(
        !ok && err.contains(&format!("schema is at version {behind}")),
        "{err}"
    );
}
