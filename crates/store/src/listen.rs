//! The addresses the store serves on: TCP, or a Unix domain socket that an
//! Envoy on the same host reaches through a `pipe` address (no TCP stack
//! between them), and several at once: the API on a socket for the Envoy
//! beside the store and on TCP for the monitoring and operators.

use tokio::net::TcpListener;
#[cfg(unix)]
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::{AppState, Surface};

/// One bound address.
pub enum Listener {
    Tcp(TcpListener),
    #[cfg(unix)]
    Unix(UnixListener, SocketFile),
}

/// The addresses one surface is served on, all alike.
pub struct Listeners(pub Vec<Listener>);

impl From<TcpListener> for Listeners {
    fn from(listener: TcpListener) -> Listeners {
        Listeners(vec![Listener::Tcp(listener)])
    }
}

/// A store that was killed leaves its socket file behind, and binding the
/// path again needs it gone. Only such a file goes: a socket another store
/// still answers on stays (two stores on one path would split its traffic
/// unseen), and so does anything that is not a socket (a mistyped path must
/// never delete a database).
#[cfg(unix)]
fn remove_dead_socket(path: &str) -> std::io::Result<()> {
    use std::io::{Error, ErrorKind};
    use std::os::unix::fs::FileTypeExt;
    match std::fs::symlink_metadata(path) {
        Err(_) => Ok(()),
        Ok(m) if !m.file_type().is_socket() => Err(Error::new(
            ErrorKind::AlreadyExists,
            "a file that is not a socket is there, and it is left alone",
        )),
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => Err(Error::new(
                ErrorKind::AddrInUse,
                "another process is listening on this socket",
            )),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => std::fs::remove_file(path),
            // Not known to be dead (a socket this user may not reach, say).
            Err(e) => Err(e),
        },
    }
}

/// The socket file a listener made: removed when the store stops, unless
/// the path has meanwhile become another's (a store started after this one
/// stopped accepting, which found the socket dead and bound it again).
#[cfg(unix)]
pub struct SocketFile {
    path: std::path::PathBuf,
    id: (u64, u64),
}

#[cfg(unix)]
impl SocketFile {
    fn of(path: &std::path::Path) -> std::io::Result<SocketFile> {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::symlink_metadata(path)?;
        Ok(SocketFile {
            path: path.to_path_buf(),
            id: (m.dev(), m.ino()),
        })
    }

    fn remove(self) {
        let still_ours = SocketFile::of(&self.path).is_ok_and(|now| now.id == self.id);
        if !still_ours {
            return;
        }
        if let Err(e) = std::fs::remove_file(&self.path) {
            tracing::warn!(path = %self.path.display(), "the socket file stays behind: {e}");
        }
    }
}

impl Listener {
    /// Binds `addr`: `host:port`, or `unix:/path` (a socket file that an
    /// earlier run left there and nothing listens on any more is replaced).
    pub async fn bind(addr: &str) -> std::io::Result<Listener> {
        #[cfg(unix)]
        if let Some(path) = addr.strip_prefix("unix:") {
            remove_dead_socket(path)?;
            let listener = UnixListener::bind(path)?;
            let file = SocketFile::of(std::path::Path::new(path))?;
            return Ok(Listener::Unix(listener, file));
        }
        TcpListener::bind(addr).await.map(Listener::Tcp)
    }

    /// Serves `surface` of `state` here until `stop` turns true; in-flight
    /// requests finish before the task ends.
    pub(crate) fn serve(
        self,
        state: AppState,
        surface: Surface,
        mut stop: watch::Receiver<bool>,
    ) -> JoinHandle<std::io::Result<()>> {
        let stopped = async move {
            let _ = stop.wait_for(|s| *s).await;
        };
        // Each connection carries what it has shown (`auth::Connection`),
        // so its credential is hashed once, not on every request.
        let service =
            crate::surface(state, surface).into_make_service_with_connect_info::<crate::auth::Connection>();
        match self {
            Listener::Tcp(l) => {
                if let Ok(addr) = l.local_addr() {
                    tracing::info!(?surface, "listening on {addr}");
                }
                let server = axum::serve(l, service).with_graceful_shutdown(stopped);
                tokio::spawn(async move { server.await })
            }
            #[cfg(unix)]
            Listener::Unix(l, file) => {
                tracing::info!(?surface, "listening on unix:{}", file.path.display());
                let server = axum::serve(l, service).with_graceful_shutdown(stopped);
                tokio::spawn(async move {
                    let served = server.await;
                    file.remove();
                    served
                })
            }
        }
    }
}
