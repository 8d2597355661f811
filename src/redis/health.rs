//! What is known of each server's reachability. A server that refuses, hangs or is gone costs its policies one
//! probe every few seconds, not a connection attempt each (with its retries, seconds per policy): a reconcile of a
//! policy whose server is known down fails at once with the error the last probe saw, and the first reconcile
//! after the server's back-off is due starts the next probe. Probes run on their own task; a reconcile waits for
//! one at most [`PROBE_WAIT`] and is otherwise deferred, so a server that does not answer holds no reconcile slot
//! for longer than that, however many policies use it.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use redis::RedisError;
use tokio::sync::watch;
use tracing::{info, warn};

/// How long a reconcile waits for a probe of its server before it is deferred. A server that answers does so in
/// milliseconds; one that does not would otherwise hold the slot for the connection timeout.
pub const PROBE_WAIT: Duration = Duration::from_millis(250);
/// The longest wait between two probes of a server that is down: how soon its policies see it back.
const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// What the last probe (or the last command) said of a server.
#[derive(Clone, Debug)]
pub enum Seen {
    Up,
    /// Down since the last probe: `error` is what it saw, and no new probe starts before `retry_at`.
    Down {
        server: String,
        error: RedisError,
        retry_at: Instant,
    },
}

#[derive(Default)]
struct Server {
    failures: u32,
    /// Sends the probe's outcome to the reconciles waiting for it; `None` while no probe runs.
    probing: Option<watch::Receiver<Option<Seen>>>,
    seen: Option<Seen>,
}

/// What a reconcile may do about its server now.
pub enum Admission {
    /// Connect: the server answered last time (or a probe just said so).
    Go,
    /// Known down: fail with this, without trying.
    Down { server: String, error: RedisError, retry_at: Instant },
    /// No probe has said anything yet: this caller starts one and sends its outcome here.
    Probe(watch::Sender<Option<Seen>>),
    /// A probe runs: wait for it (at most [`PROBE_WAIT`]).
    Wait(watch::Receiver<Option<Seen>>),
}

/// Reachability by server address (`host:port` of the URL a policy names; a sentinel's for `mode: Sentinel`).
#[derive(Default)]
pub struct Reachability(Mutex<HashMap<String, Server>>);

impl Reachability {
    pub fn admit(&self, key: &str) -> Admission {
        let mut servers = self.0.lock().expect("reachability lock");
        let server = servers.entry(key.to_string()).or_default();
        if let Some(probing) = &server.probing {
            return Admission::Wait(probing.clone());
        }
        match &server.seen {
            Some(Seen::Up) => Admission::Go,
            Some(Seen::Down { server, error, retry_at }) if Instant::now() < *retry_at => {
                Admission::Down { server: server.clone(), error: error.clone(), retry_at: *retry_at }
            }
            // Never probed, or due again.
            _ => {
                let (send, receive) = watch::channel(None);
                server.probing = Some(receive);
                Admission::Probe(send)
            }
        }
    }

    /// Records what a probe or a command saw: `Ok` the server answered, `Err((server, error))` it could not be
    /// reached. Returns the state recorded (a failure backs off 0.5 s, 1 s, 2 s ... up to [`MAX_BACKOFF`]).
    pub fn record(&self, key: &str, outcome: Result<(), (String, RedisError)>) -> Seen {
        let mut servers = self.0.lock().expect("reachability lock");
        let entry = servers.entry(key.to_string()).or_default();
        entry.probing = None;
        let seen = match outcome {
            Ok(()) => {
                entry.failures = 0;
                Seen::Up
            }
            Err((server, error)) => {
                entry.failures = entry.failures.saturating_add(1);
                let backoff = Duration::from_millis(500).saturating_mul(1 << entry.failures.min(8)) / 2;
                Seen::Down { server, error, retry_at: Instant::now() + backoff.min(MAX_BACKOFF) }
            }
        };
        match (&entry.seen, &seen) {
            (Some(Seen::Down { .. }), Seen::Up) => info!(server = key, "the server answers again"),
            (None | Some(Seen::Up), Seen::Down { server, error, retry_at }) => {
                let next = retry_at.saturating_duration_since(Instant::now());
                warn!(
                    server = key, %error,
                    "{server} cannot be reached: its policies fail at once with this until it answers a probe again \
                     (the next in {next:?}, then less and less often, at least every {MAX_BACKOFF:?})"
                );
            }
            _ => {}
        }
        entry.seen = Some(seen.clone());
        seen
    }

    /// When the next probe of a server known down is due; `None` when it is not known down.
    pub fn retry_at(&self, key: &str) -> Option<Instant> {
        match &self.0.lock().expect("reachability lock").get(key)?.seen {
            Some(Seen::Down { retry_at, .. }) => Some(*retry_at),
            _ => None,
        }
    }

    /// Forgets the servers not in `keys` (no policy uses them any more).
    pub fn retain<'a>(&self, keys: impl IntoIterator<Item = &'a str>) {
        let keep: std::collections::HashSet<&str> = keys.into_iter().collect();
        self.0.lock().expect("reachability lock").retain(|key, _| keep.contains(key.as_str()));
    }

    pub fn len(&self) -> usize {
        self.0.lock().expect("reachability lock").len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::ErrorKind;

    fn refused() -> (String, RedisError) {
        ("127.0.0.1:1".into(), RedisError::from((ErrorKind::Io, "Connection refused")))
    }

    #[test]
    fn the_first_caller_probes_the_others_wait_and_then_all_go_or_fail_without_trying() {
        let reach = Reachability::default();
        let Admission::Probe(send) = reach.admit("a:1") else { panic!("the first caller probes") };
        let Admission::Wait(mut wait) = reach.admit("a:1") else { panic!("the second waits") };
        assert!(matches!(reach.admit("b:1"), Admission::Probe(_)), "another server is probed apart");
        let seen = reach.record("a:1", Err(refused()));
        let _ = send.send(Some(seen));
        assert!(matches!(wait.borrow_and_update().clone(), Some(Seen::Down { .. })));
        let Admission::Down { error, retry_at, .. } = reach.admit("a:1") else { panic!("known down: no new try") };
        assert!(error.to_string().contains("Connection refused"));
        assert!(retry_at > Instant::now() && retry_at <= Instant::now() + Duration::from_millis(500));
        reach.record("a:1", Ok(()));
        assert!(matches!(reach.admit("a:1"), Admission::Go));
    }

    #[test]
    fn a_server_down_again_and_again_is_probed_less_and_less_often_up_to_a_bound() {
        let reach = Reachability::default();
        let waits: Vec<Duration> = (0..8)
            .map(|_| match reach.record("a:1", Err(refused())) {
                Seen::Down { retry_at, .. } => retry_at.duration_since(Instant::now()),
                Seen::Up => unreachable!(),
            })
            .collect();
        let rounded: Vec<u64> = waits.iter().map(|w| (w.as_millis() as u64).div_ceil(100) * 100).collect();
        assert_eq!(rounded, [500, 1000, 2000, 4000, 8000, 8000, 8000, 8000]);
    }

    #[test]
    fn a_due_server_gets_one_new_probe() {
        let reach = Reachability::default();
        let Admission::Probe(_) = reach.admit("a:1") else { panic!() };
        let mut servers = reach.0.lock().unwrap();
        let entry = servers.get_mut("a:1").unwrap();
        entry.probing = None;
        let (server, error) = refused();
        entry.seen = Some(Seen::Down { server, error, retry_at: Instant::now() - Duration::from_millis(1) });
        drop(servers);
        assert!(matches!(reach.admit("a:1"), Admission::Probe(_)));
        assert!(matches!(reach.admit("a:1"), Admission::Wait(_)));
    }
}
