//! Whether a group's consumers make progress: a sample of the server's counters at each refresh, a window of them
//! per policy, and from the window the rates, the drain time and the `Consuming` condition. Judged over the window,
//! never on a threshold (Burrow's way): one slow sample is no verdict. No IO here, so every rule is a unit test on a
//! sequence of samples.

use std::collections::VecDeque;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use k8s_openapi::jiff::Timestamp;

use crate::api::{CONSUMING, Rates};
use crate::context::conditions::{Said, condition};
use crate::redis::{Backlog, GroupFacts, Unread};

/// Samples a verdict is judged on: the newest and the four before it, one refresh (`spec.reclaim.interval`)
/// apart, so the window spans four intervals.
pub const WINDOW: usize = 5;

pub const PROGRESSING: &str = "Progressing";
pub const NO_CONSUMERS: &str = "NoConsumers";
pub const NOT_PROGRESSING: &str = "NotProgressing";
pub const FALLING_BEHIND: &str = "FallingBehind";
/// Fewer than [`WINDOW`] samples since the operator started, and no earlier verdict to keep.
pub const MEASURING: &str = "Measuring";
/// The message of the verdict said at once, from the last sample alone, when there is no backlog.
const CAUGHT_UP: &str = "caught up: nothing unread or pending";
/// The message while a backlog has come since "caught up" and the window is not full yet.
const BACKLOG_SINCE: &str = "caught up at the last verdict; entries came since: judged again once a window is full";

/// The server's counters at one refresh.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sample {
    /// Server time, in milliseconds.
    pub at_ms: i64,
    /// The stream's `entries-added`.
    pub added: Option<i64>,
    /// The group's `entries-read`.
    pub read: Option<i64>,
    /// The group's lag, when the server can tell it.
    pub lag: Option<i64>,
    pub pending: i64,
    /// Lag (or its bound) + pending: what the consumers still have to do.
    pub backlog: i64,
    /// Entries the operator itself took out of the PEL (requeued, dead-lettered, payload gone): no consumer's work.
    pub operator_acks: i64,
    /// Consumers of the group, the operator's own excluded.
    pub consumers: i64,
}

impl Sample {
    pub fn of(facts: &GroupFacts) -> Sample {
        let total = |name: &str| facts.totals.get(name).copied().unwrap_or(0);
        Sample {
            at_ms: facts.server_time_ms,
            added: facts.entries_added,
            read: facts.entries_read,
            lag: facts.lag,
            pending: facts.pending,
            backlog: Backlog::of(facts).total(),
            operator_acks: total("requeued") + total("deadLettered") + total("payloadDeleted"),
            consumers: facts.consumers,
        }
    }
}

/// The latest [`WINDOW`] samples of one policy, oldest first, and what its last probe found unread (so the next
/// one can skip the `XRANGE` when nothing changed).
#[derive(Clone, Debug, Default)]
pub struct Window {
    samples: VecDeque<Sample>,
    pub unread: Option<Unread>,
}

impl Window {
    /// Keeps `sample` when it was taken at least `spacing_ms` after the newest one kept (reconciles that an edit or
    /// an Event brings in between do not squeeze the window). A counter that went back (the stream or the group
    /// re-created, the group moved) starts the window again.
    pub fn push(&mut self, sample: Sample, spacing_ms: i64) {
        if let Some(newest) = self.samples.back() {
            let back = |a: Option<i64>, b: Option<i64>| matches!((a, b), (Some(a), Some(b)) if b < a);
            if back(newest.added, sample.added) || back(newest.read, sample.read) || sample.at_ms < newest.at_ms {
                self.samples.clear();
            } else if sample.at_ms - newest.at_ms < spacing_ms {
                return;
            }
        }
        self.samples.push_back(sample);
        while self.samples.len() > WINDOW {
            self.samples.pop_front();
        }
    }

    fn span(&self) -> Option<(&Sample, &Sample, f64)> {
        let (first, last) = (self.samples.front()?, self.samples.back()?);
        let seconds = (last.at_ms - first.at_ms) as f64 / 1000.0;
        (seconds > 0.0).then_some((first, last, seconds))
    }

    /// Entries read for the first time between two samples: from `entries-read`, else from what was added minus
    /// what the lag grew by; `None` when the server tells neither.
    fn read_between(a: &Sample, b: &Sample) -> Option<i64> {
        match (a.read, b.read, a.added, b.added, a.lag, b.lag) {
            (Some(r0), Some(r1), ..) => Some(r1 - r0),
            (_, _, Some(a0), Some(a1), Some(l0), Some(l1)) => Some((a1 - a0) - (l1 - l0)),
            _ => None,
        }
    }

    /// Entries the consumers acknowledged between two samples: read, minus what the PEL grew by, minus what the
    /// operator took out of it.
    fn acknowledged_between(a: &Sample, b: &Sample) -> Option<i64> {
        let read = Self::read_between(a, b)?;
        Some((read - (b.pending - a.pending) - (b.operator_acks - a.operator_acks)).max(0))
    }

    /// Per second over the window; `None` until two samples are kept.
    pub fn rates(&self) -> Option<Rates> {
        let (first, last, seconds) = self.span()?;
        let per_second = |n: i64| (n.max(0) as f64 / seconds * 100.0).round() / 100.0;
        Some(Rates {
            added: per_second(last.added? - first.added?),
            read: Self::read_between(first, last).map(per_second),
            acknowledged: Self::acknowledged_between(first, last).map(per_second),
        })
    }

    /// Seconds until the backlog is gone at the rate it shrank over the window: 0 without a backlog, `None` while
    /// it does not shrink.
    pub fn drain_seconds(&self) -> Option<i64> {
        let last = self.samples.back()?;
        if last.backlog == 0 {
            return Some(0);
        }
        let (first, _, seconds) = self.span()?;
        let shrink_per_second = (first.backlog - last.backlog) as f64 / seconds;
        (shrink_per_second > 0.0).then(|| (last.backlog as f64 / shrink_per_second).ceil() as i64)
    }

    /// The verdict and why, or `None` while the window is not full and nothing can be said yet.
    pub fn verdict(&self) -> Option<(&'static str, String)> {
        let last = self.samples.back()?;
        if last.backlog == 0 {
            return Some((PROGRESSING, CAUGHT_UP.into()));
        }
        if last.consumers == 0 {
            return Some((
                NO_CONSUMERS,
                format!(
                    "backlog {} and the group has no consumer: nothing reads it; start the consumers (or check what \
                     scales them)",
                    last.backlog
                ),
            ));
        }
        if self.samples.len() < WINDOW {
            return None;
        }
        let first = self.samples.front()?;
        let steps = || self.samples.iter().zip(self.samples.iter().skip(1));
        let moved = steps().any(|(a, b)| {
            Self::read_between(a, b).is_some_and(|n| n > 0) || Self::acknowledged_between(a, b).is_some_and(|n| n > 0)
        });
        let waiting = self.samples.iter().all(|s| s.backlog > 0);
        if waiting && !moved {
            return Some((
                NOT_PROGRESSING,
                format!(
                    "backlog {}, {} consumers, and nothing was read or acknowledged across the last {WINDOW} samples: \
                     the consumers are stuck or gone; kubectl pelican status shows who holds the oldest entries",
                    last.backlog, last.consumers
                ),
            ));
        }
        if moved && steps().all(|(a, b)| b.backlog > a.backlog) {
            return Some((
                FALLING_BEHIND,
                format!(
                    "the backlog grew at each of the last {WINDOW} samples (from {} to {}) while the consumers read: \
                     the producers are faster; add consumers or make them faster",
                    first.backlog, last.backlog
                ),
            ));
        }
        Some((PROGRESSING, format!("the consumers read and acknowledge; backlog {}", last.backlog)))
    }

    /// Samples kept.
    pub fn taken(&self) -> usize {
        self.samples.len()
    }
}

/// The `Consuming` condition from the window: the verdict, or while there is none yet (fewer samples than a window:
/// an operator restart starts the window again), the earlier one, unless the last sample contradicts it: a consumer
/// came after `NoConsumers` (then `Unknown` `Measuring`), or a backlog after "caught up" (then still Progressing, the
/// message saying so). Without an earlier one, `Unknown` `Measuring`.
pub fn consuming(previous: &[Condition], window: &Window, generation: Option<i64>, now: Timestamp) -> Condition {
    let measuring = || {
        let taken = window.taken();
        ("Unknown", MEASURING, format!("{taken} of {WINDOW} samples taken: a verdict needs a whole window"))
    };
    let last = window.samples.back();
    let (status, reason, message) = match window.verdict() {
        Some((reason, message)) => (if reason == PROGRESSING { "True" } else { "False" }, reason, message),
        None => match previous.iter().find(|c| c.type_ == CONSUMING) {
            Some(old) if old.reason == NO_CONSUMERS && last.is_some_and(|s| s.consumers > 0) => measuring(),
            Some(old) if [CAUGHT_UP, BACKLOG_SINCE].contains(&old.message.as_str()) => {
                ("True", PROGRESSING, BACKLOG_SINCE.to_string())
            }
            Some(old) => return Condition { observed_generation: generation, ..old.clone() },
            None => measuring(),
        },
    };
    condition(previous, Said { type_: CONSUMING, status, reason, message }, generation, now)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One sample per second: `added` and `read` as the server counts them, the lag and PEL they leave.
    fn at(second: i64, added: i64, read: i64, pending: i64, consumers: i64) -> Sample {
        let lag = added - read;
        Sample {
            at_ms: second * 1000,
            added: Some(added),
            read: Some(read),
            lag: Some(lag),
            pending,
            backlog: lag + pending,
            operator_acks: 0,
            consumers,
        }
    }

    fn window(samples: impl IntoIterator<Item = Sample>) -> Window {
        let mut window = Window::default();
        for sample in samples {
            window.push(sample, 900);
        }
        window
    }

    fn reason(window: &Window) -> Option<&'static str> {
        window.verdict().map(|(reason, _)| reason)
    }

    #[test]
    fn a_steady_load_the_consumers_keep_up_with_is_progressing_at_every_window() {
        // 100 entries a second, read at once, the PEL and the lag wobbling between 0 and a few: ten windows.
        let wobble = [0, 3, 1, 2, 0, 4, 1, 0, 2, 3, 1, 0, 2, 1, 4, 0, 3, 2, 1, 0];
        let mut window = Window::default();
        let mut verdicts = Vec::new();
        for (s, lag) in (0..50).zip(wobble.iter().cycle()) {
            let added = 100 * s + 5;
            window.push(at(s, added, added - lag, lag % 3, 4), 900);
            verdicts.extend(reason(&window));
        }
        assert!(verdicts.len() >= 50 - 4, "a verdict once the window is full, or at once when caught up");
        assert!(verdicts.iter().all(|r| *r == PROGRESSING), "{verdicts:?}");
        let rates = window.rates().unwrap();
        assert_eq!(rates.added, 100.0);
        assert!((rates.read.unwrap() - 100.0).abs() <= 1.0, "{rates:?}");
    }

    #[test]
    fn consumers_that_stop_are_not_progressing_after_one_window() {
        let mut window = window((0..5).map(|s| at(s, 10 * s, 10 * s, 2, 2)));
        assert_eq!(reason(&window), Some(PROGRESSING));
        // They stop after second 4: entries keep coming, nothing is read.
        for s in 5..8 {
            window.push(at(s, 10 * s, 40, 2, 2), 900);
            assert_eq!(reason(&window), Some(PROGRESSING), "second {s}: the window still saw reads");
        }
        window.push(at(8, 80, 40, 2, 2), 900);
        let (reason, message) = window.verdict().unwrap();
        assert_eq!(reason, NOT_PROGRESSING);
        assert!(message.contains("2 consumers") && message.contains("last 5 samples"), "{message}");
        // One acknowledgement is progress, but with the backlog still growing at every sample it is falling behind.
        window.push(at(9, 90, 40, 1, 2), 900);
        assert_eq!(window.verdict().unwrap().0, FALLING_BEHIND);
        // They catch up.
        window.push(at(10, 100, 95, 1, 2), 900);
        assert_eq!(window.verdict().unwrap().0, PROGRESSING);
    }

    #[test]
    fn no_consumer_with_a_backlog_is_said_at_once_and_an_empty_group_is_fine() {
        let window = window([at(0, 5, 0, 0, 0)]);
        assert_eq!(reason(&window), Some(NO_CONSUMERS));
        let idle = self::window([at(0, 5, 5, 0, 0)]);
        assert_eq!(reason(&idle), Some(PROGRESSING), "nothing to do needs no consumer");
    }

    #[test]
    fn a_backlog_growing_at_every_sample_while_consumers_read_is_falling_behind() {
        // 100 added a second, 60 read.
        let mut window = window((0..5).map(|s| at(s, 100 * s, 60 * s, 10, 3)));
        let (reason, message) = window.verdict().unwrap();
        assert_eq!(reason, FALLING_BEHIND);
        assert!(message.contains("from 10 to 170"), "{message}");
        assert_eq!(window.drain_seconds(), None, "a growing backlog has no drain time");
        // One sample where the backlog shrank: no longer growing over the whole window.
        window.push(at(5, 500, 460, 10, 3), 900);
        assert_eq!(window.verdict().unwrap().0, PROGRESSING);
    }

    #[test]
    fn rates_and_the_drain_time_follow_the_counters() {
        // 1,000 waiting, nothing added, 50 read and acknowledged a second.
        let window = window((0..5).map(|s| at(s, 1000, 50 * s, 0, 1)));
        let rates = window.rates().unwrap();
        assert_eq!((rates.added, rates.read, rates.acknowledged), (0.0, Some(50.0), Some(50.0)));
        // 800 left at 50 a second.
        assert_eq!(window.drain_seconds(), Some(16));
        // Acknowledgements the operator made itself (dead-lettering) are no consumer's progress.
        let mut stuck = (0..5).map(|s| at(s, 10, 10, 10 - s, 1)).collect::<Vec<_>>();
        for (s, sample) in stuck.iter_mut().enumerate() {
            sample.operator_acks = s as i64;
        }
        let stuck = self::window(stuck);
        assert_eq!(stuck.rates().unwrap().acknowledged, Some(0.0));
        assert_eq!(reason(&stuck), Some(NOT_PROGRESSING));
    }

    #[test]
    fn without_entries_read_the_reads_come_from_the_lag() {
        let mut samples: Vec<Sample> = (0..5).map(|s| at(s, 100 + 10 * s, 20 * s, 0, 1)).collect();
        samples.iter_mut().for_each(|s| s.read = None);
        let window = window(samples);
        assert_eq!(window.rates().unwrap().read, Some(20.0));
        let mut blind: Vec<Sample> = (0..5).map(|s| at(s, 100, 0, 0, 1)).collect();
        blind.iter_mut().for_each(|s| (s.read, s.lag) = (None, None));
        assert_eq!(self::window(blind).rates().unwrap().read, None);
    }

    #[test]
    fn close_samples_are_skipped_and_a_counter_going_back_starts_again() {
        let mut window = window([at(0, 10, 10, 0, 1), at(1, 20, 20, 0, 1)]);
        window.push(Sample { at_ms: 1_500, ..at(1, 25, 25, 0, 1) }, 900);
        assert_eq!(window.taken(), 2, "half an interval after the last one");
        // The stream was deleted and created again: entries-added starts from 0.
        window.push(at(3, 2, 2, 0, 1), 900);
        assert_eq!(window.taken(), 1);
    }

    #[test]
    fn the_condition_keeps_its_last_verdict_until_a_window_says_otherwise() {
        let t0 = Timestamp::UNIX_EPOCH;
        let first = consuming(&[], &window([at(0, 9, 4, 0, 1)]), Some(1), t0);
        assert_eq!((first.status.as_str(), first.reason.as_str()), ("Unknown", MEASURING));
        let stuck = consuming(&[], &window((0..5).map(|s| at(s, 9, 4, 1, 1))), Some(1), t0);
        assert_eq!((stuck.status.as_str(), stuck.reason.as_str()), ("False", NOT_PROGRESSING));
        // An operator restart: one sample, not enough for a verdict; the earlier one stays.
        let later = Timestamp::from_second(60).unwrap();
        let kept = consuming(std::slice::from_ref(&stuck), &window([at(0, 9, 4, 1, 1)]), Some(2), later);
        assert_eq!((kept.reason.as_str(), kept.observed_generation), (NOT_PROGRESSING, Some(2)));
    }

    /// The demo's first minute: the first sample finds nothing to read (caught up, said at once), the next ones a
    /// backlog, before a window is full. "Caught up" must not stay beside a backlog of 12 (the verdict stays, its
    /// message says entries came since); nor "no consumers" once one came.
    #[test]
    fn a_verdict_said_from_one_sample_gives_way_when_the_next_contradicts_it() {
        let t0 = Timestamp::UNIX_EPOCH;
        let caught_up = consuming(&[], &window([at(0, 0, 0, 0, 1)]), Some(1), t0);
        assert_eq!((caught_up.status.as_str(), caught_up.message.as_str()), ("True", CAUGHT_UP));
        let busy = window([at(0, 0, 0, 0, 1), at(1, 20, 12, 4, 1)]);
        let now = consuming(std::slice::from_ref(&caught_up), &busy, Some(1), t0);
        assert_eq!(
            (now.status.as_str(), now.reason.as_str(), now.message.as_str()),
            ("True", PROGRESSING, BACKLOG_SINCE)
        );
        assert_eq!(now.last_transition_time, caught_up.last_transition_time, "no flap");
        let busier = window([at(0, 0, 0, 0, 1), at(1, 20, 12, 4, 1), at(2, 40, 30, 4, 1)]);
        let still = consuming(std::slice::from_ref(&now), &busier, Some(1), t0);
        assert_eq!(still, now, "one write, not one per sample");
        let alone = consuming(&[], &window([at(0, 9, 0, 0, 0)]), Some(1), t0);
        assert_eq!(alone.reason, NO_CONSUMERS);
        let joined = window([at(0, 9, 0, 0, 0), at(1, 9, 2, 2, 1)]);
        let now = consuming(std::slice::from_ref(&alone), &joined, Some(1), t0);
        assert_eq!(now.reason, MEASURING, "{}", now.message);
    }
}
