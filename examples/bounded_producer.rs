//! A producer for a bounded stream, built on Pelican's SDK: it publishes through the
//! bounded-publish script and treats the two failure kinds differently.
//!
//!   cargo run --example bounded_producer -- redis://127.0.0.1:6379/0 orders 1000
//!
//! - refused (`PELICAN_BACKLOG_FULL`): certainly not written. Wait with exponential backoff and full jitter, capped,
//!   then try the same entry again; after a number of tries give it back to the caller (here: count it as shed).
//! - outcome unknown (the connection broke after sending): it may be in the stream. Look it up by the producer's own
//!   `msg_id` before publishing it again, so a retry never duplicates it.

use std::time::Duration;

use pelican::worker::{Producer, PublishError};

/// Tries per entry before the producer gives up on it (sheds it, and says so).
const MAX_TRIES: u32 = 8;
const BASE: Duration = Duration::from_millis(50);
const CAP: Duration = Duration::from_secs(5);

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let url = args.next().unwrap_or_else(|| "redis://127.0.0.1:6379/0".into());
    let stream = args.next().unwrap_or_else(|| "orders".into());
    let count: u64 = args.next().and_then(|n| n.parse().ok()).unwrap_or(1000);
    let client = redis::Client::open(url)?;
    let producer = Producer::connect(&client, &stream).await?;
    let mut reader = client.get_multiplexed_async_connection().await?;
    let (mut published, mut shed) = (0, 0);
    for n in 0..count {
        let msg_id = format!("order-{n}");
        let mut tries = 0;
        loop {
            tries += 1;
            match producer.publish(&[("msg_id", msg_id.as_str()), ("amount", "42")]).await {
                Ok(_) => {
                    published += 1;
                    break;
                }
                Err(PublishError::Refused { group, backlog, max }) if tries < MAX_TRIES => {
                    let wait = backoff(tries);
                    eprintln!("{msg_id}: refused ({group} at {backlog}/{max}), retrying in {wait:?}");
                    tokio::time::sleep(wait).await;
                }
                Err(PublishError::OutcomeUnknown(e)) if tries < MAX_TRIES => {
                    eprintln!("{msg_id}: outcome unknown ({e}); checking before a retry");
                    tokio::time::sleep(backoff(tries)).await;
                    if already_written(&mut reader, &stream, &msg_id).await? {
                        published += 1;
                        break;
                    }
                }
                Err(e) => {
                    eprintln!("{msg_id}: giving up after {tries} tries: {e}");
                    shed += 1;
                    break;
                }
            }
        }
    }
    println!("published {published}, shed {shed}");
    Ok(())
}

/// Exponential backoff with full jitter: a random wait in [0, min(CAP, BASE * 2^tries)).
fn backoff(tries: u32) -> Duration {
    let ceiling = BASE.saturating_mul(1 << tries.min(16)).min(CAP);
    ceiling.mul_f64(jitter())
}

/// A number in [0, 1) from the clock's nanoseconds: enough to spread producers apart.
fn jitter() -> f64 {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().subsec_nanos();
    f64::from(nanos % 1_000_000) / 1_000_000.0
}

/// Whether an entry with this `msg_id` is among the stream's newest entries (where a lost reply's entry would be).
async fn already_written(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    msg_id: &str,
) -> redis::RedisResult<bool> {
    let recent: redis::streams::StreamRangeReply =
        redis::cmd("XREVRANGE").arg(stream).arg("+").arg("-").arg("COUNT").arg(1000).query_async(conn).await?;
    Ok(recent.ids.iter().any(|entry| entry.get::<String>("msg_id").as_deref() == Some(msg_id)))
}
