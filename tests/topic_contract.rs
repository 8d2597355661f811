//! The topic contract (contract/README.md, "Topics (contract version 2)") against real Redis 7.0 and Valkey 9.1: the
//! partition vector, and `membership.lua` through the Rust wrapper: balanced, sticky assignment, hand-over only after
//! a release or an expiry, a higher epoch at every hand-over, a bounded group; and where a topic's keys live.

#[macro_use]
mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use common::*;
use pelican::keys::{epochs_key, members_key, owners_key, partition_stream, settings_key, slot, terminal_key};
use pelican::topic::{Assignment, MAX_PARTITIONS, Member, heartbeat, partition_of, sweep};

on_both_servers!(
    three_members_joining_one_by_one_end_balanced_moving_only_what_balance_needs,
    a_leaving_member_frees_its_partitions_only_with_its_release,
    a_silent_member_expires_after_its_ttl_and_its_partitions_move_with_a_higher_epoch,
    an_over_target_member_keeps_its_partitions_until_it_says_it_released_them,
    the_member_beyond_the_limit_is_refused_and_nothing_is_written,
    a_seeded_random_run_never_shows_a_partition_with_two_owners,
);

const TOPIC: &str = "orders";
const GROUP: &str = "billing";
const LONG_TTL: Duration = Duration::from_secs(60);

/// A server, a runtime and an async connection for the wrapper's calls; the latest answer of each member.
struct Group {
    server: Server,
    runtime: tokio::runtime::Runtime,
    conn: redis::aio::MultiplexedConnection,
    latest: BTreeMap<String, Assignment>,
}

impl Group {
    fn start(flavor: Flavor) -> Group {
        let server = Server::start(flavor);
        let runtime = runtime();
        let client = redis::Client::open(server.url()).unwrap();
        let conn = runtime.block_on(client.get_multiplexed_async_connection()).unwrap();
        Group { server, runtime, conn, latest: BTreeMap::new() }
    }

    fn call(&mut self, member: &Member, leaving: bool, released: &[u32]) -> redis::RedisResult<Assignment> {
        let answer = self.runtime.block_on(heartbeat(&mut self.conn, member, leaving, released))?;
        self.latest.insert(member.name.clone(), answer.clone());
        self.assert_one_owner_each();
        Ok(answer)
    }

    /// A heartbeat that releases `released`.
    fn beat(&mut self, member: &Member, released: &[u32]) -> Assignment {
        self.call(member, false, released).unwrap_or_else(|e| panic!("{}: {e}", member.name))
    }

    /// Every member beats, releasing at once what it was told to, until a round changes nothing (at most 10).
    fn settle(&mut self, members: &[Member]) {
        for _ in 0..10 {
            let before = self.latest.clone();
            for member in members {
                let release = self.latest.get(&member.name).map(|a| a.release.clone()).unwrap_or_default();
                self.beat(member, &release);
            }
            if self.latest == before {
                return;
            }
        }
        panic!("no stable assignment after 10 rounds: {:?}", self.latest);
    }

    fn partitions_of(&self, name: &str) -> Vec<u32> {
        self.latest[name].owned.iter().map(|(p, _)| *p).collect()
    }

    fn epochs_of(&self, name: &str) -> BTreeMap<u32, u64> {
        self.latest[name].owned.iter().copied().collect()
    }

    /// The latest answers of all members never name one partition twice.
    fn assert_one_owner_each(&self) {
        let mut seen = BTreeMap::new();
        for (name, answer) in &self.latest {
            for (p, _) in &answer.owned {
                if let Some(other) = seen.insert(*p, name) {
                    panic!("partition {p} owned by {other} and {name}: {:?}", self.latest);
                }
            }
        }
    }

    /// The owners hash as the server holds it.
    fn owners(&self) -> BTreeMap<u32, String> {
        redis::cmd("HGETALL").arg(owners_key(TOPIC, GROUP)).query(&mut self.server.conn()).unwrap()
    }
}

fn member(name: &str, ttl: Duration, partitions: u32) -> Member {
    Member { topic: TOPIC.into(), group: GROUP.into(), name: name.into(), ttl, partitions }
}

/// Partition -> owner, over the latest answers.
fn ownership(group: &Group) -> BTreeMap<u32, String> {
    group.latest.iter().flat_map(|(name, a)| a.owned.iter().map(move |(p, _)| (*p, name.clone()))).collect()
}

#[test]
fn the_published_vector_covers_every_kind_of_key_and_matches_partition_of() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/contract/partitions.json")).unwrap();
    let vector: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut sizes = BTreeSet::new();
    let (mut empty, mut multibyte, mut long, mut not_utf8) = (false, false, false, false);
    for case in vector["cases"].as_array().unwrap() {
        let key = match (case["key"].as_str(), case["keyHex"].as_str()) {
            (Some(text), None) => {
                empty |= text.is_empty();
                multibyte |= text.len() > text.chars().count();
                long |= text.len() >= 256;
                text.as_bytes().to_vec()
            }
            (None, Some(hex)) => {
                let bytes: Vec<u8> =
                    (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
                assert!(std::str::from_utf8(&bytes).is_err(), "keyHex is for bytes that are not UTF-8: {case}");
                not_utf8 = true;
                bytes
            }
            _ => panic!("a case has key or keyHex: {case}"),
        };
        let partitions = case["partitions"].as_u64().unwrap() as u32;
        sizes.insert(partitions);
        assert_eq!(u64::from(partition_of(&key, partitions)), case["partition"].as_u64().unwrap(), "{case}");
    }
    assert_eq!(sizes, BTreeSet::from([1, 2, 3, 7, 16, MAX_PARTITIONS]));
    assert!(
        empty && multibyte && long && not_utf8,
        "empty {empty}, multi-byte {multibyte}, long {long}, hex {not_utf8}"
    );
}

#[test]
fn the_membership_keys_share_the_topics_slot_and_partitions_spread() {
    let topic_slot = slot(&settings_key(TOPIC, GROUP));
    for key in [members_key(TOPIC, GROUP), owners_key(TOPIC, GROUP), epochs_key(TOPIC, GROUP)] {
        assert_eq!(slot(&key), topic_slot, "{key}");
    }
    let slots: BTreeSet<u16> = (0..16).map(|i| slot(&partition_stream(TOPIC, i))).collect();
    assert!(slots.len() >= 10, "16 partitions over {} slots: {slots:?}", slots.len());
    // A partition's own keys (terminal, errors, ...) follow it, and partition 3 of two topics are apart.
    let third = partition_stream(TOPIC, 3);
    assert_eq!(slot(&terminal_key(&third, GROUP)), slot(&third));
    assert_ne!(slot(&third), slot(&partition_stream("refunds", 3)));
}

fn three_members_joining_one_by_one_end_balanced_moving_only_what_balance_needs(flavor: Flavor) {
    let mut group = Group::start(flavor);
    let members: Vec<Member> = ["worker-a", "worker-b", "worker-c"].map(|n| member(n, LONG_TTL, 11)).into();
    let mut previous: BTreeMap<u32, String> = BTreeMap::new();
    for (joined, target) in [(1, 11), (2, 5), (3, 3)] {
        group.settle(&members[..joined]);
        let now = ownership(&group);
        assert_eq!(now.len(), 11, "every partition owned: {now:?}");
        let newcomer = &members[joined - 1].name;
        let moved: Vec<_> = previous.iter().filter(|(p, owner)| now[p] != **owner).collect();
        assert!(moved.iter().all(|(p, _)| &now[p] == newcomer), "only to the newcomer: {moved:?} -> {now:?}");
        if joined > 1 {
            assert_eq!(moved.len(), target, "the newcomer's share moved, nothing more: {moved:?}");
        }
        assert_eq!(group.partitions_of(newcomer).len(), target);
        assert_eq!(group.owners(), now, "the server's owners hash says the same");
        previous = now;
    }
    let counts: Vec<usize> = members.iter().map(|m| group.partitions_of(&m.name).len()).collect();
    assert_eq!(counts, [4, 4, 3]);
    assert_eq!(group.latest["worker-c"].members, 3);
}

fn a_leaving_member_frees_its_partitions_only_with_its_release(flavor: Flavor) {
    let mut group = Group::start(flavor);
    let (a, b) = (member("worker-a", LONG_TTL, 4), member("worker-b", LONG_TTL, 4));
    group.settle(&[a.clone(), b.clone()]);
    assert_eq!((group.partitions_of("worker-a"), group.partitions_of("worker-b")), (vec![0, 1], vec![2, 3]));
    let epochs_before = group.epochs_of("worker-a");

    // Until worker-a says it leaves, worker-b gets nothing more.
    assert_eq!(group.beat(&b, &[]).owned.len(), 2);
    let left = group.call(&a, true, &[]).unwrap();
    assert_eq!((left.owned.len(), left.members), (0, 1), "{left:?}");

    let b_now = group.beat(&b, &[]);
    assert_eq!(group.partitions_of("worker-b"), [0, 1, 2, 3], "{b_now:?}");
    for (p, epoch) in &epochs_before {
        assert_eq!(group.epochs_of("worker-b")[p], epoch + 1, "partition {p} handed over: a new epoch");
    }
    assert_eq!(b_now.members, 1);
}

fn a_silent_member_expires_after_its_ttl_and_its_partitions_move_with_a_higher_epoch(flavor: Flavor) {
    let mut group = Group::start(flavor);
    let short = member("worker-a", Duration::from_millis(300), 6);
    let long = member("worker-b", LONG_TTL, 6);
    group.settle(&[short.clone(), long.clone()]);
    let lost = group.epochs_of("worker-a");
    assert_eq!(lost.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);

    // worker-a stops calling; the operator's sweep drops it once its ttl has passed on the server's clock.
    let Group { runtime, conn, .. } = &mut group;
    let live = wait_for("worker-a to expire", Duration::from_secs(5), || {
        match runtime.block_on(sweep(conn, TOPIC, GROUP, 6)).map_err(|e| e.to_string())? {
            1 => Ok(1),
            n => Err(format!("{n} members")),
        }
    });
    assert_eq!(live, 1);
    // Its last answer is no longer its own (what a paused worker does with it is the contract's warning).
    group.latest.remove("worker-a");
    assert!(group.owners().values().all(|owner| owner == "worker-b"), "{:?}", group.owners());

    group.beat(&long, &[]);
    assert_eq!(group.partitions_of("worker-b"), [0, 1, 2, 3, 4, 5]);
    for (p, epoch) in &lost {
        assert!(group.epochs_of("worker-b")[p] > *epoch, "partition {p}: {:?}", group.epochs_of("worker-b"));
    }

    // Back after its expiry, worker-a finds its old partitions gone (another owner, another epoch).
    let back = group.beat(&short, &[]);
    assert!(back.owned.is_empty(), "{back:?}");
    assert_eq!(group.beat(&long, &[]).release, [3, 4, 5], "worker-b hands back the newcomer's share");
}

fn an_over_target_member_keeps_its_partitions_until_it_says_it_released_them(flavor: Flavor) {
    let mut group = Group::start(flavor);
    let (a, b) = (member("worker-a", LONG_TTL, 8), member("worker-b", LONG_TTL, 8));
    assert_eq!(group.beat(&a, &[]).owned.len(), 8);
    assert!(group.beat(&b, &[]).owned.is_empty(), "nothing free yet");
    assert_eq!(group.beat(&a, &[]).release, [4, 5, 6, 7], "its highest-numbered ones");
    assert!(group.beat(&b, &[]).owned.is_empty(), "told to release is not released");
    assert_eq!(group.owners().values().filter(|o| *o == "worker-a").count(), 8);

    // A release of someone else's partition is ignored; a partial release moves just that.
    let after_partial = group.beat(&a, &[4, 5]);
    assert_eq!((after_partial.owned.len(), after_partial.release), (6, vec![6, 7]));
    group.beat(&b, &[0, 1]);
    assert_eq!(group.partitions_of("worker-b"), [4, 5]);
    assert_eq!(group.partitions_of("worker-a"), [0, 1, 2, 3, 6, 7], "worker-b cannot release worker-a's");
    group.beat(&a, &[6, 7]);
    group.beat(&b, &[]);
    assert_eq!(
        (group.partitions_of("worker-a"), group.partitions_of("worker-b")),
        (vec![0, 1, 2, 3], vec![4, 5, 6, 7])
    );
    assert!(group.epochs_of("worker-b").values().all(|e| *e == 2), "taken once by a, once by b: {:?}", group.latest);
}

fn the_member_beyond_the_limit_is_refused_and_nothing_is_written(flavor: Flavor) {
    let mut group = Group::start(flavor);
    for i in 0..1024 {
        group.beat(&member(&format!("worker-{i:04}"), LONG_TTL, 2), &[]);
    }
    let late = member("worker-late", LONG_TTL, 2);
    let error = group.call(&late, false, &[]).unwrap_err().to_string();
    assert!(error.contains("PELICAN_TOO_MANY_MEMBERS") && error.contains("1024"), "{error}");
    let mut conn = group.server.conn();
    let (count, late_deadline): (u32, Option<String>) = redis::pipe()
        .cmd("HLEN")
        .arg(members_key(TOPIC, GROUP))
        .cmd("HGET")
        .arg(members_key(TOPIC, GROUP))
        .arg("worker-late")
        .query(&mut conn)
        .unwrap();
    assert_eq!((count, late_deadline), (1024, None));

    // A member already in beats on; once one leaves, the late one joins.
    assert_eq!(group.beat(&member("worker-0000", LONG_TTL, 2), &[]).members, 1024);
    group.call(&member("worker-0001", LONG_TTL, 2), true, &[]).unwrap();
    assert_eq!(group.beat(&late, &[]).members, 1024);
}

fn a_seeded_random_run_never_shows_a_partition_with_two_owners(flavor: Flavor) {
    const PARTITIONS: u32 = 13;
    let mut group = Group::start(flavor);
    let members: Vec<Member> = (0..5).map(|i| member(&format!("worker-{i}"), LONG_TTL, PARTITIONS)).collect();
    let mut random = Lcg(67);
    let mut epochs: BTreeMap<u32, u64> = BTreeMap::new();
    for _ in 0..400 {
        let who = &members[random.next_in(0, 5) as usize];
        let told = group.latest.get(&who.name).map(|a| a.release.clone()).unwrap_or_default();
        // It releases some of what it was told (a handler may still be busy), now and then a partition not its own.
        let mut released: Vec<u32> = told.into_iter().filter(|_| random.next_in(0, 3) > 0).collect();
        if random.next_in(0, 10) == 0 {
            released.push(random.next_in(0, u64::from(PARTITIONS)) as u32);
        }
        let leaving = random.next_in(0, 20) == 0;
        // `call` checks the latest answers of all members after each call.
        let answer = group.call(who, leaving, &released).unwrap();
        for (p, epoch) in answer.owned {
            assert!(epoch >= epochs.get(&p).copied().unwrap_or(0), "partition {p}'s epoch went back");
            epochs.insert(p, epoch);
        }
        let owners = group.owners();
        for (p, owner) in ownership(&group) {
            assert_eq!(owners.get(&p), Some(&owner), "an answer names an owner the server does not hold");
        }
    }
    group.settle(&members);
    let counts: Vec<usize> = members.iter().map(|m| group.partitions_of(&m.name).len()).collect();
    assert_eq!(counts, [3, 3, 3, 2, 2], "balanced once every member released what it was told");
}
