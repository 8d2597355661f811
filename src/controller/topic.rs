//! A topic (a policy with `spec.partitions`, SPEC 22) seen as one: what the probes of its partitions found, summed
//! up for the status. Pure, so every rule is a plain unit test.

use std::collections::BTreeMap;

use crate::api::{IdempotenceStatus, PartitionBacklog, PartitionsStatus};
use crate::keys;
use crate::redis::{Backlog, GroupFacts};

/// The topic's facts from its partitions': counts summed (pending, lag, lengths, totals, terminal reasons), the
/// oldest pending entry and the oldest unread one over all partitions, the consumers of the busiest partition (a
/// worker reads several partitions under one name), and the dead-letter stream's length once (it is one stream),
/// or summed when each partition has its own (`dead_letter_each`, on a Cluster). A lag, `entries-added` or
/// `entries-read` that one partition cannot tell makes the topic's unknown.
pub fn facts(partitions: &[GroupFacts], dead_letter_each: bool) -> GroupFacts {
    let sum_known = |of: fn(&GroupFacts) -> Option<i64>| partitions.iter().map(of).sum::<Option<i64>>();
    let mut other_groups: Vec<String> = partitions.iter().flat_map(|p| p.other_groups.iter().cloned()).collect();
    other_groups.sort();
    other_groups.dedup();
    let oldest_pending = partitions
        .iter()
        .filter_map(|p| p.oldest_pending.as_ref())
        .min_by_key(|o| o.id_millis().unwrap_or(i64::MAX))
        .cloned();
    GroupFacts {
        has_group: !partitions.is_empty() && partitions.iter().all(|p| p.has_group),
        stream_length: partitions.iter().map(|p| p.stream_length).sum(),
        lag: sum_known(|p| p.lag),
        pending: partitions.iter().map(|p| p.pending).sum(),
        oldest_pending,
        consumers: partitions.iter().map(|p| p.consumers).max().unwrap_or(0),
        dead_letter_length: if dead_letter_each {
            partitions.iter().map(|p| p.dead_letter_length).sum()
        } else {
            partitions.iter().map(|p| p.dead_letter_length).max().unwrap_or(0)
        },
        totals: summed(partitions.iter().map(|p| &p.totals)),
        terminal: summed(partitions.iter().map(|p| &p.terminal)),
        publish_rejected: partitions.iter().map(|p| p.publish_rejected).sum(),
        bound: None,
        other_groups,
        server_time_ms: partitions.iter().map(|p| p.server_time_ms).max().unwrap_or(0),
        entries_added: sum_known(|p| p.entries_added),
        idempotence: None,
        entries_read: sum_known(|p| p.entries_read),
        oldest_unread_ms: partitions.iter().filter_map(|p| p.oldest_unread_ms).min(),
        // The probe of the next reconcile reads each partition's oldest unread entry afresh.
        unread: None,
    }
}

/// The topic's idempotent production: the window in force on every partition (absent unless each reports one), the
/// producers and message ids remembered, the entries added and the duplicates refused, summed over the partitions (a
/// producer publishing to N partitions counts N times).
pub fn idempotence(partitions: &[GroupFacts]) -> Option<IdempotenceStatus> {
    let each: Option<Vec<&IdempotenceStatus>> = partitions.iter().map(|p| p.idempotence.as_ref()).collect();
    let each = each?;
    let first = each.first()?;
    let sum = |count: fn(&IdempotenceStatus) -> i64| each.iter().map(|i| count(i)).sum();
    Some(IdempotenceStatus {
        producers: sum(|i| i.producers),
        message_ids: sum(|i| i.message_ids),
        added: sum(|i| i.added),
        duplicates: sum(|i| i.duplicates),
        ..(*first).clone()
    })
}

fn summed<'a>(counts: impl Iterator<Item = &'a BTreeMap<String, i64>>) -> BTreeMap<String, i64> {
    let mut all = BTreeMap::new();
    for (name, count) in counts.flatten() {
        *all.entry(name.clone()).or_insert(0) += count;
    }
    all
}

/// `status.partitions`: how many partitions, how many have the group, and on a Cluster how many each primary serves
/// (`slots`: `(first, last, primary)` from `CLUSTER SLOTS`; empty for a single server).
pub fn summary(topic: &str, partitions: &[GroupFacts], slots: &[(u16, u16, String)]) -> PartitionsStatus {
    let mut shards = BTreeMap::new();
    if !slots.is_empty() {
        for index in 0..partitions.len() as u32 {
            let slot = keys::slot(&keys::partition_stream(topic, index));
            let primary = slots.iter().find(|(first, last, _)| (*first..=*last).contains(&slot));
            let name = primary.map_or("unserved", |(_, _, primary)| primary.as_str());
            *shards.entry(name.to_string()).or_insert(0) += 1;
        }
    }
    let largest_backlog = (0u32..)
        .zip(partitions)
        .map(|(partition, facts)| PartitionBacklog { partition, backlog: Backlog::of(facts).total() })
        .max_by_key(|p| (p.backlog, std::cmp::Reverse(p.partition)));
    PartitionsStatus {
        count: partitions.len() as u32,
        with_group: partitions.iter().filter(|p| p.has_group).count() as u32,
        shards,
        members: 0,
        largest_backlog,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::redis::OldestPending;

    fn partition(pending: i64, lag: Option<i64>, oldest_ms: i64) -> GroupFacts {
        let oldest = OldestPending { id: format!("{oldest_ms}-0"), consumer: "w".into(), idle_ms: 5, deliveries: 1 };
        GroupFacts {
            has_group: true,
            stream_length: 10,
            lag,
            pending,
            oldest_pending: (pending > 0).then_some(oldest),
            consumers: 2,
            dead_letter_length: 7,
            totals: [("deadLettered".to_string(), 1), ("requeued".to_string(), 2)].into(),
            terminal: [("Invalid".to_string(), 3)].into(),
            server_time_ms: 1_000_000,
            entries_added: Some(10),
            entries_read: Some(8),
            oldest_unread_ms: Some(oldest_ms + 1),
            ..GroupFacts::default()
        }
    }

    #[test]
    fn counts_are_summed_over_the_partitions() {
        let topic = facts(&[partition(1, Some(2), 500), partition(3, Some(4), 400), partition(0, Some(0), 900)], false);
        assert_eq!((topic.pending, topic.lag, topic.stream_length), (4, Some(6), 30));
        assert_eq!(topic.totals, [("deadLettered".to_string(), 3), ("requeued".to_string(), 6)].into());
        assert_eq!(topic.terminal, [("Invalid".to_string(), 9)].into());
        assert_eq!((topic.entries_added, topic.entries_read), (Some(30), Some(24)));
    }

    #[test]
    fn the_oldest_pending_entry_is_the_oldest_of_any_partition() {
        let topic = facts(&[partition(1, Some(0), 500), partition(3, Some(0), 400), partition(0, Some(0), 100)], false);
        assert_eq!(topic.oldest_pending.map(|o| o.id).as_deref(), Some("400-0"), "a partition with none is skipped");
        assert_eq!(topic.oldest_unread_ms, Some(101));
    }

    #[test]
    fn the_dead_letter_stream_and_the_consumers_are_not_counted_per_partition() {
        let topic = facts(&[partition(1, None, 500), partition(1, None, 500)], false);
        assert_eq!((topic.dead_letter_length, topic.consumers), (7, 2));
        let on_a_cluster = facts(&[partition(1, None, 500), partition(1, None, 500)], true);
        assert_eq!(on_a_cluster.dead_letter_length, 14, "a dead-letter stream per partition");
    }

    #[test]
    fn a_lag_one_partition_cannot_tell_leaves_the_topic_lag_unknown() {
        assert_eq!(facts(&[partition(1, Some(5), 1), partition(1, None, 1)], false).lag, None);
    }

    #[test]
    fn the_summary_counts_partitions_with_the_group_and_their_shards() {
        let without = GroupFacts { has_group: false, ..partition(0, Some(0), 1) };
        let partitions = [partition(0, Some(0), 1), without, partition(0, Some(0), 1), partition(0, Some(0), 1)];
        let slots = [(0, 8191, "a:7000".to_string()), (8192, 16383, "b:7001".to_string())];
        let summary = summary("t", &partitions, &slots);
        assert_eq!((summary.count, summary.with_group), (4, 3));
        assert_eq!(summary.shards.values().sum::<u32>(), 4);
        let by_hand = |primary: &str| {
            let on = |i: u32| keys::slot(&keys::partition_stream("t", i)) >= 8192;
            (0..4).filter(|i| on(*i) == (primary == "b:7001")).count() as u32
        };
        for (primary, count) in &summary.shards {
            assert_eq!(*count, by_hand(primary), "{primary}");
        }
        assert!(super::summary("t", &partitions, &[]).shards.is_empty(), "no Cluster, no shards");
    }
}
