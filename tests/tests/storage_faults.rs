//! The store's disk fills up mid-traffic, through the real Envoy: clients get
//! `503 store-unavailable` with `Retry-After` (fail closed), nothing executes
//! twice, and service resumes once space is freed, without restarting Envoy
//! or the store.

// Test support: failing loudly is how a test reports.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use e2e::report::verdict;
use std::io::Write;
use std::time::{Duration, Instant};

use e2e::stack::{Database, Options, Stack};
use e2e::{fresh_key, send};

const PAYMENT: &str = r#"{"amount": 4200, "currency": "EUR"}"#;

/// A tmpfs of `size`, unmounted when dropped.
struct SmallDisk(tempfile::TempDir);

/// Set in the environment of a test run again in a user namespace.
const IN_USER_NAMESPACE: &str = "IDEMGATE_IN_USER_NAMESPACE";

/// Where the test can have its tmpfs.
enum Tmpfs {
    Here(SmallDisk),
    /// The test ran again, with its tmpfs, in a user namespace of its own,
    /// and passed there.
    RanInUserNamespace,
    /// Why the test cannot run here.
    Unavailable(String),
}

impl SmallDisk {
    /// Mounts a tmpfs of `size` for `test` (its name in this test binary).
    /// Not root, the test runs again in a user namespace of its own
    /// (`unshare --user --map-root-user --mount`), where it is root of its
    /// own mounts and the store it starts sees its tmpfs; if it fails there,
    /// this panics with its output.
    fn mount(size: &str, test: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let mount = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output();
        let refused = match mount {
            Ok(m) if m.status.success() => return Tmpfs::Here(SmallDisk(dir)),
            Ok(m) => String::from_utf8_lossy(&m.stderr).trim().to_string(),
            Err(e) => format!("mount: {e}"),
        };
        // In the namespace, where a tmpfs was just mounted, this is a failure.
        assert!(
            std::env::var_os(IN_USER_NAMESPACE).is_none(),
            "mounting a tmpfs in a user namespace failed: {refused}"
        );
        eprintln!("{refused}: trying a user namespace");
        let namespace = ["--user", "--map-root-user", "--mount"];
        let probe = std::process::Command::new("unshare")
            .args(namespace)
            .args(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(dir.path())
            .output();
        match probe {
            Ok(p) if p.status.success() => {}
            Ok(p) => {
                let why = String::from_utf8_lossy(&p.stderr).trim().to_string();
                return Tmpfs::Unavailable(format!(
                    "mounting a tmpfs needs root or a user namespace, and this user may not create one: {why}"
                ));
            }
            Err(e) => {
                return Tmpfs::Unavailable(format!(
                    "mounting a tmpfs needs root or a user namespace, and unshare cannot be run: {e}"
                ));
            }
        }
        let run = std::process::Command::new("unshare")
            .args(namespace)
            .arg("--")
            .arg(std::env::current_exe().unwrap())
            .args([
                test,
                "--exact",
                "--nocapture",
                "--test-threads=1",
                "--color=never",
            ])
            .env(IN_USER_NAMESPACE, "1")
            // The row is this process's to write.
            .env_remove("IDEMGATE_REPORT")
            .output()
            .unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr),
        );
        // A test that did not run is not a pass either.
        assert!(
            run.status.success() && stdout.contains("test result: ok. 1 passed"),
            "{test} in a user namespace: {}\n{stdout}\n{stderr}",
            run.status
        );
        eprintln!("{test} ran in a user namespace:\n{stdout}{stderr}");
        Tmpfs::RanInUserNamespace
    }

    fn fill(&self) {
        let mut f = std::fs::File::create(self.0.path().join("filler")).unwrap();
        let chunk = vec![0x5au8; 64 * 1024];
        while f.write_all(&chunk).is_ok() {}
        while f.write_all(&chunk[..512]).is_ok() {}
    }

    fn free(&self) {
        std::fs::remove_file(self.0.path().join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.0.path())
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_under_the_store_gets_503s_and_service_resumes_once_space_is_freed() {
    let verdict = verdict(
        "storage fault: SQLite disk full (through Envoy)",
        "Envoy and the store on a 32 MiB tmpfs, payments before, during and after",
        "the disk filled mid-traffic; 503 store-unavailable with Retry-After, nothing executes twice, service resumes without restarts",
    );
    let test = "a_full_disk_under_the_store_gets_503s_and_service_resumes_once_space_is_freed";
    let disk = match SmallDisk::mount("32m", test) {
        Tmpfs::Here(disk) => disk,
        // It passed there (had it failed, so would this run): `passed`.
        Tmpfs::RanInUserNamespace => return,
        Tmpfs::Unavailable(why) => return verdict.skip(&why),
    };
    let mut stack = Stack::start(Options::new("envoy/e2e.yaml", Database::Sqlite, 1)).await;
    // The store again, on the small disk; Envoy stays up throughout.
    stack.kill_store(0);
    stack.database_url = format!("sqlite://{}", disk.0.path().join("store.db").display());
    stack.start_store(0);
    stack.wait_store(0).await;

    let before = fresh_key("full-before");
    assert_eq!(send(stack.post("/pay", Some(&before), PAYMENT)).await.status, 201);

    // Four clients send payments throughout; the disk fills under them.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let client = |c: usize| {
        let (stack, stop) = (&stack, &stop);
        async move {
            let (mut executed, mut refused) = (Vec::new(), Vec::new());
            for i in 0..2_000 {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                let key = fresh_key(&format!("full-{c}-{i}"));
                let a = send(stack.post("/pay", Some(&key), PAYMENT)).await;
                match (a.status, a.problem().as_deref()) {
                    (201, _) => executed.push(key),
                    (503, Some("store-unavailable")) => {
                        assert!(
                            a.header("retry-after").is_some(),
                            "a 503 without Retry-After: {a:?}"
                        );
                        refused.push(key);
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    _ => panic!("unexpected answer while the disk fills: {a:?}"),
                }
            }
            (executed, refused)
        }
    };
    let filling = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        disk.fill();
        tokio::time::sleep(Duration::from_secs(2)).await;
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let (a, b, c, d, ()) = tokio::join!(client(0), client(1), client(2), client(3), filling);
    let (mut executed, mut refused) = (Vec::new(), Vec::new());
    for (e, r) in [a, b, c, d] {
        executed.extend(e);
        refused.extend(r);
    }
    assert!(
        refused.len() >= 10,
        "the full disk refused only {} requests",
        refused.len()
    );
    for key in &refused {
        assert_eq!(
            stack.upstream.executions(key),
            0,
            "a refused request was executed"
        );
    }

    disk.free();
    let freed = Instant::now();
    let mut recovered = None;
    for key in &refused {
        // Each refused request, retried with its key, executes exactly once.
        loop {
            let a = send(stack.post("/pay", Some(key), PAYMENT)).await;
            match (a.status, a.problem().as_deref()) {
                (201, _) => break,
                (503, Some("store-unavailable")) if freed.elapsed() < Duration::from_secs(10) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                _ => panic!("unexpected answer after space was freed: {a:?}"),
            }
        }
        recovered.get_or_insert_with(|| freed.elapsed());
        assert_eq!(stack.upstream.executions(key), 1);
    }
    eprintln!(
        "disk full through Envoy: {} executed, {} refused; served again {:?} after space was freed",
        executed.len(),
        refused.len(),
        recovered.unwrap_or_default()
    );
    // What executed before and while the disk was full never runs again. It
    // replays, unless the disk refused its completion after the upstream had
    // answered: the client got that answer, and the record stays in progress
    // until its lease turns it unknown (docs/contract.md §5).
    let mut unrecorded = 0;
    for key in executed.iter().chain([&before]) {
        let a = send(stack.post("/pay", Some(key), PAYMENT)).await;
        match (a.status, a.problem().as_deref()) {
            (201, _) => assert_eq!(a.header("idempotent-replayed"), Some("true"), "{key}: {a:?}"),
            (409, Some("request-in-progress" | "outcome-unknown")) => unrecorded += 1,
            _ => panic!("{key}: {a:?}"),
        }
        assert_eq!(stack.upstream.executions(key), 1, "{key} executed twice");
    }
    eprintln!("of those executed, {unrecorded} had their completion refused by the full disk");
}
