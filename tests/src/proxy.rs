//! A TCP proxy the test controls, put between Envoy and a store replica: it
//! forwards both ways, or swallows the store's replies (the store acted, its
//! answer never arrives), as a dying store or a lossy network would.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

pub struct Proxy {
    swallow: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on `port` and forwards every connection to `target`.
    pub async fn start(port: u16, target: u16) -> Proxy {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap_or_else(|e| panic!("proxy on {port}: {e}"));
        let swallow = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&swallow);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let flag = Arc::clone(&flag);
                tokio::spawn(async move {
                    // A store that is down: the connection is closed at once.
                    let Ok(store) = TcpStream::connect(("127.0.0.1", target)).await else {
                        return;
                    };
                    let (mut client_rx, mut client_tx) = client.into_split();
                    let (mut store_rx, mut store_tx) = store.into_split();
                    let requests = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut client_rx, &mut store_tx).await;
                        let _ = store_tx.shutdown().await;
                    });
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        match store_rx.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) if flag.load(Ordering::SeqCst) => {}
                            Ok(n) => {
                                if client_tx.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    let _ = client_tx.shutdown().await;
                    requests.abort();
                });
            }
        });
        Proxy { swallow, task }
    }

    /// From now on, the store's replies are read and dropped (or, with
    /// `false`, forwarded again).
    pub fn swallow_replies(&self, on: bool) {
        self.swallow.store(on, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
