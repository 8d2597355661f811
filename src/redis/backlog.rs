//! A group's backlog (what its consumers still have to do) read in one round trip, and the latest reading per
//! policy, so that any number of askers (KEDA's polls and pushes, every reconcile) cost one read per policy per
//! `max_age` at most.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{Value, pipe};
use tokio::time::Instant;

use super::reply;
use super::{Conn, GroupFacts};
use crate::{Error, Result};

/// The numbers the backlog is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Backlog {
    pub stream_length: i64,
    /// Entries not yet delivered to the group; `None` when the server cannot tell (entries past the group's
    /// position were deleted or trimmed).
    pub lag: Option<i64>,
    /// Entries delivered and not acknowledged.
    pub pending: i64,
    /// Age in seconds of the oldest entry not yet delivered to the group; 0 when nothing is unread.
    pub lag_seconds: i64,
}

impl Backlog {
    pub fn of(facts: &GroupFacts) -> Backlog {
        Backlog {
            stream_length: facts.stream_length,
            lag: facts.lag,
            pending: facts.pending,
            lag_seconds: facts.lag_seconds(),
        }
    }

    /// The lag; when the server cannot tell it, every entry of the stream counts as unread (an upper bound), so it
    /// is never 0 while unread entries exist. Redis 7.0 overstates the lag after a trim or XDEL: entries not yet
    /// delivered can never outnumber the stream.
    pub fn lag_or_bound(&self) -> i64 {
        self.lag.map_or(self.stream_length, |lag| lag.min(self.stream_length))
    }

    /// Lag (or its bound) + pending: `status.backlog`, and the number the bounded-publish script refuses at.
    pub fn total(&self) -> i64 {
        self.lag_or_bound() + self.pending
    }

    /// Two partitions' backlog as one topic's: counts summed, the lag unknown when either cannot tell it, the age
    /// of the oldest unread entry of either.
    pub fn and(self, other: Backlog) -> Backlog {
        Backlog {
            stream_length: self.stream_length + other.stream_length,
            lag: self.lag.zip(other.lag).map(|(a, b)| a + b),
            pending: self.pending + other.pending,
            lag_seconds: self.lag_seconds.max(other.lag_seconds),
        }
    }
}

/// `XINFO GROUPS`, `XLEN` and `TIME`, pipelined: the group's lag and pending count, and the stream's length; then,
/// while the group has something to read, the oldest unread entry (for its age). `None` when the stream has no
/// such group.
pub async fn probe_backlog(conn: &mut Conn, server: &str, stream: &str, group: &str) -> Result<Option<Backlog>> {
    let (groups, stream_length, (seconds, micros)): (Vec<Value>, i64, (i64, i64)) = pipe()
        .cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .cmd("XLEN")
        .arg(stream)
        .cmd("TIME")
        .query_async(conn)
        .await
        .map_err(|e| Error::from_redis(server, e))?;
    let Some(group) = groups
        .into_iter()
        .filter_map(reply::fields)
        .find(|fields| reply::get::<String>(fields, "name").as_deref() == Some(group))
    else {
        return Ok(None);
    };
    let lag = reply::get(&group, "lag");
    let last_delivered = reply::get::<String>(&group, "last-delivered-id");
    let oldest_unread = super::group::oldest_unread_ms(conn, server, stream, last_delivered.as_deref(), lag).await?;
    let now_ms = seconds * 1000 + micros / 1000;
    Ok(Some(Backlog {
        stream_length,
        lag,
        pending: reply::get(&group, "pending").unwrap_or(0),
        lag_seconds: oldest_unread.map_or(0, |ms| (now_ms - ms).max(0) / 1000),
    }))
}

/// The latest backlog read per policy (`namespace/name`), for the policies someone asked about.
#[derive(Default)]
pub struct Readings {
    slots: Mutex<HashMap<String, Arc<Slot>>>,
}

#[derive(Default)]
struct Slot {
    latest: Mutex<Option<(Instant, Backlog)>>,
    /// Held while the server is asked, so that concurrent askers wait for one read instead of each making one.
    reading: tokio::sync::Mutex<()>,
    asked: Mutex<Option<Instant>>,
}

/// A policy nobody asked about for this long is forgotten.
const FORGET_AFTER: Duration = Duration::from_secs(600);

impl Readings {
    /// Keeps a reading made elsewhere (a reconcile's probe), for a policy someone asked about.
    pub fn record(&self, policy: &str, backlog: Backlog) {
        let slot = self.slots.lock().expect("readings lock").get(policy).cloned();
        if let Some(slot) = slot {
            *slot.latest.lock().expect("reading lock") = Some((Instant::now(), backlog));
        }
    }

    /// The policy's backlog, read with `probe` only when the latest reading is older than `max_age`; with it,
    /// when it was read.
    pub async fn read<F, Fut, E>(&self, policy: &str, max_age: Duration, probe: F) -> Result<(Instant, Backlog), E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Backlog, E>>,
    {
        let slot = self.slot(policy);
        *slot.asked.lock().expect("asked lock") = Some(Instant::now());
        let fresh = || slot.latest.lock().expect("reading lock").filter(|(at, _)| at.elapsed() < max_age);
        if let Some(reading) = fresh() {
            return Ok(reading);
        }
        let _reading = slot.reading.lock().await;
        if let Some(reading) = fresh() {
            return Ok(reading);
        }
        let backlog = probe().await?;
        let reading = (Instant::now(), backlog);
        *slot.latest.lock().expect("reading lock") = Some(reading);
        Ok(reading)
    }

    fn slot(&self, policy: &str) -> Arc<Slot> {
        let mut slots = self.slots.lock().expect("readings lock");
        if let Some(slot) = slots.get(policy) {
            return slot.clone();
        }
        // Only a new policy pays for forgetting the old ones, not every ask.
        slots.retain(|_, slot| slot.asked.lock().expect("asked lock").is_none_or(|at| at.elapsed() < FORGET_AFTER));
        slots.entry(policy.to_string()).or_default().clone()
    }

    /// Policies with a reading kept, for `pelican_state_entries`.
    pub fn len(&self) -> usize {
        self.slots.lock().expect("readings lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn an_unknown_lag_counts_the_whole_stream() {
        let known = Backlog { stream_length: 10, lag: Some(3), pending: 2, lag_seconds: 0 };
        assert_eq!(known.total(), 5);
        let unknown = Backlog { stream_length: 10, lag: None, pending: 2, lag_seconds: 0 };
        assert_eq!(unknown.total(), 12);
        // Redis 7.0 after an XDEL: a lag larger than the stream.
        let overstated = Backlog { stream_length: 1, lag: Some(4), pending: 0, lag_seconds: 0 };
        assert_eq!(overstated.lag_or_bound(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn many_askers_cost_one_read_per_max_age() {
        let readings = Readings::default();
        let probes = AtomicUsize::new(0);
        let probe = || async {
            probes.fetch_add(1, Ordering::SeqCst);
            Ok::<_, ()>(Backlog { stream_length: 1, lag: Some(1), pending: 0, lag_seconds: 0 })
        };
        let max_age = Duration::from_secs(1);
        let asks = (0..100).map(|_| readings.read("ns/p", max_age, probe));
        for result in futures::future::join_all(asks).await {
            assert_eq!(result.unwrap().1.total(), 1);
        }
        assert_eq!(probes.load(Ordering::SeqCst), 1);
        tokio::time::advance(Duration::from_millis(500)).await;
        readings.read("ns/p", max_age, probe).await.unwrap();
        assert_eq!(probes.load(Ordering::SeqCst), 1, "half a second old: still fresh");
        tokio::time::advance(Duration::from_millis(600)).await;
        readings.read("ns/p", max_age, probe).await.unwrap();
        assert_eq!(probes.load(Ordering::SeqCst), 2);
        // A reconcile's probe counts as a reading once someone asked about the policy, and only then.
        tokio::time::advance(Duration::from_secs(2)).await;
        readings.record("ns/p", Backlog { stream_length: 7, lag: Some(7), pending: 0, lag_seconds: 0 });
        readings.record("ns/other", Backlog::default());
        assert_eq!(readings.read("ns/p", max_age, probe).await.unwrap().1.total(), 7);
        assert_eq!((probes.load(Ordering::SeqCst), readings.len()), (2, 1));
    }
}
