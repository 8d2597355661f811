//! The Rust SDK's topic producer against real Redis 7.0 and Valkey 9.1 (idempotence on Redis 8.6): each message in
//! the partition of its key, the key its first field, round robin without one, a partition's bound, and clear
//! errors for a stream that is no topic.

#[macro_use]
mod common;

use std::collections::BTreeMap;

use common::*;
use pelican::keys::{KEY_FIELD, bounds_key, partition_stream, topic_key};
use pelican::topic::partition_of;
use pelican::worker::{PublishError, Source, TopicError, TopicProducer};

on_both_servers!(
    keyed_messages_go_to_their_keys_partition_in_order_and_carry_the_key,
    messages_without_a_key_go_round_robin_over_every_partition,
    a_partitions_bound_refuses_like_a_streams,
    a_stream_no_policy_describes_as_a_topic_is_refused_by_name,
);

mod redis_8_6 {
    #[test]
    fn an_idempotent_publish_repeated_lands_once_in_one_partition_with_or_without_a_key() {
        super::an_idempotent_publish_repeated_lands_once_in_one_partition_with_or_without_a_key(super::Flavor::Redis86)
    }
}

const TOPIC: &str = "orders";

/// A topic of `partitions` as the operator describes it.
fn describe(conn: &mut redis::Connection, partitions: u32) {
    let _: () = redis::cmd("HSET")
        .arg(topic_key(TOPIC))
        .arg("partitions")
        .arg(partitions)
        .arg("contractVersion")
        .arg(2)
        .query(conn)
        .unwrap();
}

fn source(server: &Server) -> Source {
    Source::Server(redis::Client::open(server.url()).unwrap())
}

type Entry = (String, Vec<Vec<u8>>);

fn entries(conn: &mut redis::Connection, stream: &str) -> Vec<Entry> {
    redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn).unwrap()
}

fn keyed_messages_go_to_their_keys_partition_in_order_and_carry_the_key(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    describe(&mut conn, 8);
    let rt = runtime();
    let producer = rt.block_on(TopicProducer::connect_to(&source(&server), TOPIC)).unwrap();
    assert_eq!(producer.partitions(), 8);
    let keys = ["order-1", "order-2", "order-3", "order-4", "order-5"];
    for n in 0..3 {
        for key in keys {
            let (partition, _) = rt.block_on(producer.publish(Some(key.as_bytes()), &[("n", n.to_string())])).unwrap();
            assert_eq!(partition, partition_of(key.as_bytes(), 8));
        }
    }
    for key in keys {
        let stream = partition_stream(TOPIC, partition_of(key.as_bytes(), 8));
        let of_key: Vec<Vec<Vec<u8>>> =
            entries(&mut conn, &stream).into_iter().map(|e| e.1).filter(|f| f[1] == key.as_bytes()).collect();
        let expected: Vec<Vec<Vec<u8>>> =
            (0..3).map(|n| vec![KEY_FIELD.into(), key.into(), b"n".to_vec(), n.to_string().into_bytes()]).collect();
        assert_eq!(of_key, expected, "{key}: its three messages, in order, the key first, in {stream}");
    }
    let total: usize = (0..8).map(|i| entries(&mut conn, &partition_stream(TOPIC, i)).len()).sum();
    assert_eq!(total, 15, "nothing elsewhere");
    assert_eq!(entries(&mut conn, TOPIC).len(), 0, "the stream named like the topic is never written");
}

fn messages_without_a_key_go_round_robin_over_every_partition(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    describe(&mut conn, 4);
    let rt = runtime();
    let producer = rt.block_on(TopicProducer::connect_to(&source(&server), TOPIC)).unwrap();
    let mut per_partition = BTreeMap::new();
    for n in 0..12 {
        let (partition, _) = rt.block_on(producer.publish(None, &[("n", n)])).unwrap();
        *per_partition.entry(partition).or_insert(0) += 1;
    }
    assert_eq!(per_partition, BTreeMap::from([(0, 3), (1, 3), (2, 3), (3, 3)]));
    for i in 0..4 {
        let fields = &entries(&mut conn, &partition_stream(TOPIC, i))[0].1;
        assert_eq!(fields[0], b"n", "no key field without a key: {fields:?}");
    }
}

fn a_partitions_bound_refuses_like_a_streams(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    describe(&mut conn, 4);
    let key = b"customer-7";
    let stream = partition_stream(TOPIC, partition_of(key, 4));
    let _: () =
        redis::cmd("XGROUP").arg("CREATE").arg(&stream).arg("g").arg("$").arg("MKSTREAM").query(&mut conn).unwrap();
    let _: () = redis::cmd("HSET").arg(bounds_key(&stream)).arg("g").arg(1).query(&mut conn).unwrap();
    let rt = runtime();
    let producer = rt.block_on(TopicProducer::connect_to(&source(&server), TOPIC)).unwrap();
    rt.block_on(producer.publish(Some(key), &[("n", 1)])).unwrap();
    match rt.block_on(producer.publish(Some(key), &[("n", 2)])) {
        Err(PublishError::Refused { group, backlog, max }) => assert_eq!((group.as_str(), backlog, max), ("g", 1, 1)),
        other => panic!("the partition's bound of 1 refuses the second: {other:?}"),
    }
    assert_eq!(entries(&mut conn, &stream).len(), 1);
}

fn a_stream_no_policy_describes_as_a_topic_is_refused_by_name(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    let rt = runtime();
    let refused = rt.block_on(TopicProducer::connect_to(&source(&server), TOPIC)).err().unwrap();
    assert!(matches!(refused, TopicError::NotATopic { .. }), "{refused}");
    assert!(refused.to_string().contains("no policy with spec.partitions describes it"), "{refused}");
    let _: () = redis::cmd("HSET")
        .arg(topic_key(TOPIC))
        .arg("partitions")
        .arg(4)
        .arg("contractVersion")
        .arg(3)
        .query(&mut conn)
        .unwrap();
    let refused = rt.block_on(TopicProducer::connect_to(&source(&server), TOPIC)).err().unwrap();
    assert!(refused.to_string().contains("worker contract \"3\""), "{refused}");
    assert!(refused.to_string().contains("upgrade the SDK"), "{refused}");
}

fn an_idempotent_publish_repeated_lands_once_in_one_partition_with_or_without_a_key(flavor: Flavor) {
    let server = Server::start(flavor);
    let mut conn = server.conn();
    describe(&mut conn, 8);
    let rt = runtime();
    let producer = rt.block_on(TopicProducer::connect_to(&source(&server), TOPIC)).unwrap();
    let producer = rt.block_on(producer.idempotent("producer-a")).unwrap();
    for key in [Some(&b"order-9"[..]), None] {
        let message = format!("m-{}", key.is_some());
        let first = rt.block_on(producer.publish(key, &message, &[("v", 1)])).unwrap();
        let again = rt.block_on(producer.publish(key, &message, &[("v", 1)])).unwrap();
        assert_eq!(first, again, "the same partition and entry id");
        let expected = partition_of(key.unwrap_or(message.as_bytes()), 8);
        assert_eq!(first.0, expected);
    }
    let total: usize = (0..8).map(|i| entries(&mut conn, &partition_stream(TOPIC, i)).len()).sum();
    assert_eq!(total, 2, "each message once");
}
