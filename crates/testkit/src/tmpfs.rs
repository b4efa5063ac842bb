//! A small disk for disk-full tests: a tmpfs of a few MiB mounted on a
//! temporary directory, which a test fills up and frees again.
//!
//! Mounting needs root. Not root, the test runs again in a user namespace of
//! its own (`unshare --user --map-root-user --mount`), where it is root of its
//! own mounts and the processes it starts see its tmpfs; where no user
//! namespace can be created either, [`SmallDisk::mount`] says why, for the
//! test to end with `verdict.skip(&why)`:
//!
//! ```ignore
//! let disk = match SmallDisk::mount("6m", "module::the_test") {
//!     Tmpfs::Here(disk) => disk,
//!     // It passed there (had it failed, so would this run): `passed`.
//!     Tmpfs::RanInUserNamespace => return,
//!     Tmpfs::Unavailable(why) => return verdict.skip(&why),
//! };
//! ```

use std::path::PathBuf;
use std::process::Command;

/// A small tmpfs of its own, unmounted when dropped.
pub struct SmallDisk {
    dir: tempfile::TempDir,
}

/// Set in the environment of a test run again in a user namespace.
const IN_USER_NAMESPACE: &str = "IDEMGATE_IN_USER_NAMESPACE";

/// Where the test can have its tmpfs.
pub enum Tmpfs {
    Here(SmallDisk),
    /// The test ran again, with its tmpfs, in a user namespace of its own,
    /// and passed there.
    RanInUserNamespace,
    /// Why the test cannot run here.
    Unavailable(String),
}

impl SmallDisk {
    /// Mounts a tmpfs of `size` (`6m`, `32m`) for `test`: its name in the
    /// running test binary, as `--exact` wants it (`module::name` where the
    /// test sits in a module). Not root, the test runs again in a user
    /// namespace of its own (`unshare --user --map-root-user --mount`), where
    /// it is root of its own mounts and the store it starts sees its tmpfs; if
    /// it fails there, this panics with its output.
    pub fn mount(size: &str, test: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        let mount = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .output();
        let refused = match mount {
            Ok(m) if m.status.success() => return Tmpfs::Here(SmallDisk { dir }),
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
        let probe = Command::new("unshare")
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
        let run = Command::new("unshare")
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

    /// The file `name` on this disk.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes `name` until the disk is full.
    pub fn fill(&self, name: &str) {
        use std::io::Write;
        let mut f = std::fs::File::create(self.path(name)).unwrap();
        let chunk = vec![0xa5u8; 64 * 1024];
        while f.write_all(&chunk).is_ok() {}
        // Less than a chunk may be left: take that too.
        while f.write_all(&chunk[..512]).is_ok() {}
        let _ = f.sync_all();
    }

    /// Removes `name`, which [`SmallDisk::fill`] wrote: the space is free again.
    pub fn free(&self, name: &str) {
        std::fs::remove_file(self.path(name)).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}
