//! Waiting without sleeps of a guessed length: poll a condition every 25 ms
//! until it holds, and fail the test, naming what never happened, when it
//! does not within the time given.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `probe` until it is true, or fails the test after `within`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut probe: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll(what, within, || {
        let fut = probe();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `probe` until it yields a value, or fails the test after `within`.
pub async fn poll<T, F, Fut>(what: &str, within: Duration, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(value) = probe().await {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
