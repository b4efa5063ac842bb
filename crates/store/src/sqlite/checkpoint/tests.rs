use super::super::engine::{Durability, Engine};
use super::super::errors::unavailable;
use super::NUDGE_FRAMES;

async fn insert(engine: &Engine, blob: usize) {
    engine
        .write(Durability::Durable, move |w| {
            w.execute("INSERT INTO t (x) VALUES (zeroblob(?1))", [blob as i64])
                .map(drop)
                .map_err(unavailable)
        })
        .await
        .unwrap();
}

#[tokio::test]
async fn claims_that_trickle_in_cost_no_checkpoint_until_the_wal_has_grown() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("engine.db");
    let engine = Engine::open(path.to_str().unwrap(), true).unwrap();
    engine
        .write(Durability::Durable, |w| {
            w.execute_batch("CREATE TABLE t (x BLOB)").map_err(unavailable)
        })
        .await
        .unwrap();
    // Commits far apart, each of a few frames: a checkpoint after each
    // would sync the WAL and the database file twice more per commit.
    for _ in 0..5 {
        insert(&engine, 10).await;
        tokio::time::sleep(std::time::Duration::from_millis(150)).await;
    }
    let stages = engine.stages();
    assert_eq!(stages.checkpoints.get(), 0, "checkpoints while the WAL is short");
    assert_eq!(engine.commits(), (6, 6));
    // Past a nudge's worth of frames (a 4,000-byte blob fills a page), the
    // checkpointer copies them.
    for _ in 0..NUDGE_FRAMES + 50 {
        insert(&engine, 4000).await;
    }
    for _ in 0..100 {
        if stages.checkpoints.get() > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(
        stages.checkpoints.get() > 0,
        "no checkpoint after a nudge's worth of pages"
    );
    assert_eq!(engine.commits(), (NUDGE_FRAMES + 56, NUDGE_FRAMES + 56));
}
