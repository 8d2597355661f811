//! Topics: one `spec.stream` over N partition streams (contract/README.md, "Topics (contract version 2)"). The
//! partition of a key, and the membership call through which the workers of a topic's group share its partitions.

use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::ConnectionLike;
use redis::{RedisResult, Script};

use crate::keys::{epochs_key, members_key, owners_key};

static MEMBERSHIP: LazyLock<Script> = LazyLock::new(|| Script::new(include_str!("../contract/scripts/membership.lua")));

/// The most partitions a topic has, and the most live members its group admits (`membership.lua` refuses more).
pub const MAX_PARTITIONS: u32 = 1024;

/// The partition of `key` in a topic of `partitions` (1 ..= [`MAX_PARTITIONS`]): CRC-32 (ISO-HDLC, zlib's) of its
/// bytes, modulo `partitions`, as every library computes it (`contract/partitions.json`). Panics on 0 partitions.
pub fn partition_of(key: &[u8], partitions: u32) -> u32 {
    crc32fast::hash(key) % partitions
}

/// One member of a topic's group, as it calls `membership.lua`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The topic (the policy's `spec.stream`).
    pub topic: String,
    pub group: String,
    /// The member's name, unique in the group (a worker's consumer name).
    pub name: String,
    /// How long the membership lives without a heartbeat; a member beats every `ttl / 3`.
    pub ttl: Duration,
    /// The topic's partitions (`partitions` in its settings).
    pub partitions: u32,
}

/// What a heartbeat answers: the partitions the member owns now, with their epochs (a partition whose epoch
/// changed since the last heartbeat was lost and taken again: its work starts over from its pending list), the ones
/// it must finish and release (name them in a later heartbeat), and the live members.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub owned: Vec<(u32, u64)>,
    pub release: Vec<u32>,
    pub members: u32,
}

/// `membership.lua` for `member`: renews its membership, frees the partitions in `released` (it finished their
/// work), and answers its assignment. `leaving`: the member is done with everything and leaves the group (the
/// answer then owns nothing). A join beyond [`MAX_PARTITIONS`] live members is the error
/// `PELICAN_TOO_MANY_MEMBERS`.
pub async fn heartbeat<C: ConnectionLike>(
    conn: &mut C,
    member: &Member,
    leaving: bool,
    released: &[u32],
) -> RedisResult<Assignment> {
    let ttl_ms = u64::try_from(member.ttl.as_millis()).unwrap_or(u64::MAX);
    let (owned, release, members) = MEMBERSHIP
        .key(members_key(&member.topic, &member.group))
        .key(owners_key(&member.topic, &member.group))
        .key(epochs_key(&member.topic, &member.group))
        .arg(&member.name)
        .arg(ttl_ms)
        .arg(member.partitions)
        .arg(u8::from(leaving))
        .arg(released)
        .invoke_async(conn)
        .await?;
    Ok(Assignment { owned, release, members })
}

/// The operator's call: drops the members of `topic`'s `group` whose membership expired and frees their
/// partitions; answers the live members.
pub async fn sweep<C: ConnectionLike>(conn: &mut C, topic: &str, group: &str, partitions: u32) -> RedisResult<u32> {
    let (_, _, members): (Vec<(u32, u64)>, Vec<u32>, u32) = MEMBERSHIP
        .key(members_key(topic, group))
        .key(owners_key(topic, group))
        .key(epochs_key(topic, group))
        .arg("")
        .arg(0)
        .arg(partitions)
        .arg(0)
        .invoke_async(conn)
        .await?;
    Ok(members)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
    }

    /// Every case of the published vector, which every library checks too.
    #[test]
    fn partitions_match_the_contracts_vector() {
        let vector: serde_json::Value = serde_json::from_str(include_str!("../contract/partitions.json")).unwrap();
        let cases = vector["cases"].as_array().unwrap();
        assert!(cases.len() >= 54, "{}", cases.len());
        for case in cases {
            let key = match (case["key"].as_str(), case["keyHex"].as_str()) {
                (Some(text), None) => text.as_bytes().to_vec(),
                (None, Some(bytes)) => hex(bytes),
                _ => panic!("a case has key or keyHex: {case}"),
            };
            let partitions = u32::try_from(case["partitions"].as_u64().unwrap()).unwrap();
            assert_eq!(u64::from(crc32fast::hash(&key)), case["crc32"].as_u64().unwrap(), "{case}");
            assert_eq!(u64::from(partition_of(&key, partitions)), case["partition"].as_u64().unwrap(), "{case}");
        }
    }

    /// The standard check value of CRC-32/ISO-HDLC: the hash is zlib's, not another CRC-32.
    #[test]
    fn the_hash_is_crc32_iso_hdlc() {
        assert_eq!(crc32fast::hash(b"123456789"), 0xCBF4_3926);
        assert_eq!(partition_of(b"123456789", MAX_PARTITIONS), 0xCBF4_3926 % 1024);
    }
}
