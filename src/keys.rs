//! Pelican's Redis key names. Shared by the operator and the worker SDK.
//!
//! Every key names the stream and lives in the stream's hash slot: `{T}:pelican:<stream>:<group>:terminal` and
//! `...:totals`, with `T` the stream's hash tag content, or the whole stream name when it has none.

/// The part of a key Redis hashes: the content between the first `{` and the first `}` after it when that is not
/// empty, else the whole key (the Redis Cluster specification's rule).
pub fn hash_tag(key: &str) -> &str {
    if let Some(open) = key.find('{')
        && let Some(len) = key[open + 1..].find('}')
        && len > 0
    {
        return &key[open + 1..open + 1 + len];
    }
    key
}

/// The Redis Cluster hash slot of a key: CRC16 of its hash tag (or whole name), modulo 16384.
pub fn slot(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key).as_bytes()) % 16384
}

/// Whether `{T}:...` keys land in the stream's slot. They always do when the stream has a hash tag (its content
/// holds no `}`); a stream without one is hashed whole, and `{<name>}` is a tag of the same content only when the
/// name holds no `}` (`a}b`, `jobs{}v2` cannot have a key in their slot built this way).
pub fn has_same_slot_keys(stream: &str) -> bool {
    slot(&terminal_key(stream, "g")) == slot(stream)
}

/// `{T}:pelican:<stream>:<group>:terminal`: reason code -> messages ended as terminal.
pub fn terminal_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:terminal", hash_tag(stream))
}

/// `{T}:pelican:<stream>:<group>:errors`: pending entry id -> why its last delivery failed (written by workers,
/// carried to a requeued copy or into the dead letter by the operator's pass, removed when the entry leaves the PEL).
pub fn errors_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:errors", hash_tag(stream))
}

/// `{T}:pelican:<stream>:<group>:handovers`: pending entry id -> when `Reassign` last handed it over (ms), so that
/// the new owner gets [`handover_grace`] to take it up before it is handed over (and counted) again; removed when
/// the entry leaves the PEL.
pub fn handovers_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:handovers", hash_tag(stream))
}

/// `{T}:pelican:<stream>:<group>:consumers`: consumer -> its worker's last lease tick (the server's time, ms),
/// written by `lease.lua` at every tick. `Reassign` hands entries only to consumers with a heartbeat younger than
/// `minIdle`: Redis' own idle time of a consumer is reset by the pass's own `XCLAIM` to it and starts again when the
/// server loads its AOF, so it cannot tell a live process from a dead one.
pub fn consumers_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:consumers", hash_tag(stream))
}

/// How often a worker extends its leases, re-reads the settings, beats its heart and takes up hand-overs: three
/// times per `minIdle` (so an entry in flight is never idle half of it), at least every 10 s (so a lowered `minIdle`
/// is followed well within the operator's hold of it, `MIN_IDLE_HOLD`), at most every 100 ms (contract/README.md).
pub fn lease_interval(min_idle: std::time::Duration) -> std::time::Duration {
    (min_idle / 3).clamp(std::time::Duration::from_millis(100), std::time::Duration::from_secs(10))
}

/// How long an entry `Reassign` handed over is left to its new owner before it may be handed over (and counted)
/// again: three of the owner's lease ticks, at each of which a worker takes up what it was handed
/// (contract/README.md, "Hand-overs"), and never less than 2 s.
pub fn handover_grace(min_idle: std::time::Duration) -> std::time::Duration {
    (lease_interval(min_idle) * 3).max(std::time::Duration::from_secs(2))
}

/// `{T}:pelican:<stream>:<group>:creator`: the uid of the policy that created the group, so that `deletionPolicy:
/// Delete` destroys only a group its policy made (or one it says it adopts).
pub fn creator_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:creator", hash_tag(stream))
}

/// `{T}:pelican:<stream>:<group>:settings`: the group's retry settings as the operator applies them, for workers to
/// read ([`WorkerSettings`]): `minIdleMs` (an entry idle this long is taken), `retryAfterMs` (an idle every retry
/// threshold of the policy allows: what a worker sets on an entry it gives back), `maxDeliveries`. Written by the
/// operator only when they differ.
pub fn settings_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:settings", hash_tag(stream))
}

/// The worker contract this build speaks (`contract/VERSION`, `contract/README.md`): the operator publishes it in
/// the settings hash as `contractVersion`, and the SDK refuses to start on a version it does not know.
pub const CONTRACT_VERSION: u32 = 1;

/// The worker contract of a topic (a policy with `spec.partitions`, SPEC 22): the operator publishes it as
/// `contractVersion` on the topic's settings key and on each partition's, so that a worker that knows only
/// [`CONTRACT_VERSION`] (one stream, no membership, no order per key) refuses to start on a topic.
pub const TOPIC_CONTRACT_VERSION: u32 = 2;

/// The fields of [`settings_key`] workers read. The operator also keeps `heldMinIdleMs` and `heldUntilMs` there (a
/// lowered `minIdle` held back for the passes: `src/redis/scripts/publish_settings.lua`); workers ignore them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerSettings {
    pub min_idle_ms: u64,
    pub retry_after_ms: u64,
    pub max_deliveries: u32,
    /// `contractVersion`; a hash written by an operator older than the contract has none (read as version 1).
    pub contract_version: Option<u32>,
}

/// The settings name a worker contract this build does not know: the version the operator published, as written
/// (anything but ASCII digits is no version this build knows).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnknownContract {
    pub operator: String,
    /// The version this build speaks where the settings were read: [`CONTRACT_VERSION`] for a stream,
    /// [`TOPIC_CONTRACT_VERSION`] for a topic's partition.
    pub known: u32,
}

impl std::fmt::Display for UnknownContract {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the operator speaks worker contract {:?}, this SDK knows {} here: upgrade the SDK \
             (contract/README.md says what changed)",
            self.operator, self.known
        )
    }
}

impl std::error::Error for UnknownContract {}

impl WorkerSettings {
    /// The settings a hash holds: `Ok(None)` when it lacks one of the first three or holds no number there, and an
    /// error when it names a contract this build does not know. The version is read first, on its own: a hash
    /// whose other fields are missing or unreadable still says which contract it speaks.
    pub fn from_fields(
        hash: &std::collections::BTreeMap<String, String>,
    ) -> Result<Option<WorkerSettings>, UnknownContract> {
        WorkerSettings::from_fields_of(hash, CONTRACT_VERSION)
    }

    /// As [`WorkerSettings::from_fields`], where the reader speaks contract `known` (a topic's partition:
    /// [`TOPIC_CONTRACT_VERSION`]); a hash without a version is version 1, which only a reader of 1 knows.
    pub fn from_fields_of(
        hash: &std::collections::BTreeMap<String, String>,
        known: u32,
    ) -> Result<Option<WorkerSettings>, UnknownContract> {
        let contract_version = match hash.get("contractVersion") {
            None if known == CONTRACT_VERSION => None,
            None => return Err(UnknownContract { operator: String::new(), known }),
            Some(text) => match text.parse::<u32>() {
                Ok(version) if version == known && text.bytes().all(|b| b.is_ascii_digit()) => Some(version),
                _ => return Err(UnknownContract { operator: text.clone(), known }),
            },
        };
        let field = |name: &str| hash.get(name)?.parse::<u64>().ok();
        Ok((|| {
            Some(WorkerSettings {
                min_idle_ms: field("minIdleMs")?,
                retry_after_ms: field("retryAfterMs")?,
                max_deliveries: u32::try_from(field("maxDeliveries")?).ok()?,
                contract_version,
            })
        })())
    }
}

/// `{T}:pelican:<stream>:<group>:owner`: the install of Pelican that runs the group's jobs (its id, with a TTL:
/// `scripts/claim_group.lua`). On a topic, `<stream>` is the topic's name.
pub fn owner_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:owner", hash_tag(stream))
}

/// `{T}:pelican:<stream>:<group>:totals`: the operator's own counters.
pub fn totals_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:totals", hash_tag(stream))
}

/// `{T}:pelican:<stream>:bounds`: group -> `backlog.maxLength`, kept by the operator, read by the bounded-publish
/// script.
pub fn bounds_key(stream: &str) -> String {
    format!("{{{}}}:pelican:{stream}:bounds", hash_tag(stream))
}

/// `{T}:pelican:<stream>:idempotence`: policy uid -> the window of idempotent production it declares and when it
/// last said so (`scripts/idempotence_window.lua`), so that policies naming the server differently agree on one.
pub fn idempotence_key(stream: &str) -> String {
    format!("{{{}}}:pelican:{stream}:idempotence", hash_tag(stream))
}

/// `{T}:pelican:<stream>:rejected`: group -> publishes the bounded-publish script refused for it.
pub fn rejected_key(stream: &str) -> String {
    format!("{{{}}}:pelican:{stream}:rejected", hash_tag(stream))
}

/// `{T}:pelican:<dead-letter stream>:redrive:<namespace>/<name>`: the progress of one `DeadLetterRedrive` (its uid,
/// last id, counts, and when it finished), written by the same script as its moves. It stays
/// after the redrive finished, so that the same manifest applied again does not move anything twice.
pub fn redrive_key(dead_letter: &str, namespace: &str, name: &str) -> String {
    format!("{{{}}}:pelican:{dead_letter}:redrive:{namespace}/{name}", hash_tag(dead_letter))
}

/// `{T}:pelican:<dead-letter stream>:redrive-lock`: the uid and name of the one redrive that moves entries out of the
/// stream now (`scripts/redrive_lock.lua`); removed by the script call that finishes it.
pub fn redrive_lock_key(dead_letter: &str) -> String {
    format!("{{{}}}:pelican:{dead_letter}:redrive-lock", hash_tag(dead_letter))
}

/// `{T}:pelican:<stream>:<group>:seeks`: `<namespace>/<name>` of a `GroupSeek` -> its record (`scripts/seek.lua`):
/// where it is while it runs, its result once it ran, so that a seek never moves the group twice.
pub fn seeks_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:seeks", hash_tag(stream))
}

/// `{T:i}`: partition `i` of topic `T` (a policy with `spec.partitions`), a stream whose whole name is its hash tag,
/// so that a Cluster spreads the partitions over its slots and partition `i` of two topics do not share one. Every
/// per-stream key above applies to it unchanged. A topic name holds no `{` or `}` (the operator's admission refuses
/// one), so `T` here is the topic's name (contract/README.md, "Topics").
pub fn partition_stream(topic: &str, partition: u32) -> String {
    format!("{{{topic}:{partition}}}")
}

/// `{T}:pelican:T:topic`: what a producer needs of the topic `T`, whatever the group: `partitions` (N) and
/// `contractVersion` (`2`). Written by the operator for every policy of the topic (they agree on N).
pub fn topic_key(topic: &str) -> String {
    format!("{{{}}}:pelican:{topic}:topic", hash_tag(topic))
}

/// The field a producer adds, first, to an entry it publishes with a key: the key's bytes. Workers of a `PerKey`
/// topic handle the entries of one key in order; an entry without it is a key of its own.
pub const KEY_FIELD: &str = "pelican-key";

/// `{T}:pelican:T:<group>:members`: member -> its lease deadline (the server's time, ms), written by
/// `membership.lua` at every heartbeat; in the topic's own slot, beside its settings.
pub fn members_key(topic: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{topic}:{group}:members", hash_tag(topic))
}

/// `{T}:pelican:T:<group>:owners`: partition index -> the member that owns it (`membership.lua`).
pub fn owners_key(topic: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{topic}:{group}:owners", hash_tag(topic))
}

/// `{T}:pelican:T:<group>:epochs`: partition index -> its epoch, incremented by `membership.lua` at every hand-over,
/// so that a member tells a partition it kept from one it lost and took again.
pub fn epochs_key(topic: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{topic}:{group}:epochs", hash_tag(topic))
}

/// The 0.1 names, `{T}:pelican:<group>:terminal` and `...:totals`, shared by every stream of one hash tag. Read
/// only to carry their counts over once.
pub fn legacy_keys(stream: &str, group: &str) -> [String; 2] {
    let tag = hash_tag(stream);
    [format!("{{{tag}}}:pelican:{group}:totals"), format!("{{{tag}}}:pelican:{group}:terminal")]
}

/// Every key Pelican keeps for one group of `stream` (counters, errors, bounds, refusals, and the 0.1 names it
/// reads once): all in the stream's hash tag, `{T}:pelican:...`.
pub fn group_keys(stream: &str, group: &str) -> Vec<String> {
    let [legacy_totals, legacy_terminal] = legacy_keys(stream, group);
    vec![
        totals_key(stream, group),
        terminal_key(stream, group),
        errors_key(stream, group),
        handovers_key(stream, group),
        consumers_key(stream, group),
        creator_key(stream, group),
        settings_key(stream, group),
        seeks_key(stream, group),
        bounds_key(stream),
        rejected_key(stream),
        legacy_totals,
        legacy_terminal,
    ]
}

/// The consumer name the operator's reclaim pass uses; kept out of counts and metrics.
pub const OPERATOR_CONSUMER: &str = "pelican-operator";

/// The field a requeued copy carries with the message's deliveries so far.
pub const DELIVERIES_FIELD: &str = "pelican-deliveries";

/// The most bytes of a message's last error kept (by the SDK when it records one, by the operator's pass when it
/// carries one into a dead letter).
pub const ERROR_TEXT_MAX: usize = 1024;

#[cfg(test)]
mod tests {
    use super::*;

    /// The constant is the contract folder's version: a change of one without the other fails here.
    #[test]
    fn the_contract_version_is_the_contract_folders() {
        let folder = include_str!("../contract/VERSION").trim();
        assert_eq!(folder, CONTRACT_VERSION.to_string());
    }

    fn fields(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn a_contract_version_this_build_does_not_know_is_refused_by_name() {
        let mut hash = fields(&[("minIdleMs", "3000"), ("retryAfterMs", "3000"), ("maxDeliveries", "3")]);
        let unversioned = WorkerSettings::from_fields(&hash).unwrap().unwrap();
        assert_eq!(unversioned.contract_version, None, "an older operator's hash is version 1");
        hash.insert("contractVersion".into(), "2".into());
        let error = WorkerSettings::from_fields(&hash).unwrap_err().to_string();
        assert!(error.contains("contract \"2\"") && error.contains("knows 1") && error.contains("upgrade"), "{error}");
    }

    /// Defect (issue 65.3): the version was checked only when every other field parsed (`maxDeliveries` absent: the
    /// worker started and handled), and `2.0` read as 1. The version is read first, and only digits are a version.
    #[test]
    fn the_version_is_read_first_and_only_digits_are_one() {
        let unknown = |pairs: &[(&str, &str)]| WorkerSettings::from_fields(&fields(pairs)).is_err();
        assert!(unknown(&[("contractVersion", "2")]), "no other field");
        assert!(unknown(&[("minIdleMs", "x"), ("contractVersion", "2")]), "another field unreadable");
        for text in ["2.0", "1.0", " 1", "1 ", "+1", "", "01x", "99999999999"] {
            assert!(unknown(&[("minIdleMs", "1000"), ("retryAfterMs", "1000"), ("contractVersion", text)]), "{text:?}");
        }
        let known = fields(&[
            ("minIdleMs", "1000"),
            ("retryAfterMs", "1000"),
            ("maxDeliveries", "2"),
            ("contractVersion", "1"),
        ]);
        assert_eq!(WorkerSettings::from_fields(&known).unwrap().unwrap().contract_version, Some(1));
        assert_eq!(WorkerSettings::from_fields(&fields(&[("contractVersion", "1")])), Ok(None), "known, incomplete");
    }

    /// A topic's partition speaks the topic's contract: its settings say 2, and a hash without a version (1) or
    /// with another is not a partition's.
    #[test]
    fn a_partitions_worker_knows_the_topics_contract_only() {
        let settings = |version: Option<&str>| {
            let mut hash = fields(&[("minIdleMs", "1000"), ("retryAfterMs", "1000"), ("maxDeliveries", "2")]);
            if let Some(version) = version {
                hash.insert("contractVersion".into(), version.into());
            }
            WorkerSettings::from_fields_of(&hash, TOPIC_CONTRACT_VERSION)
        };
        assert_eq!(settings(Some("2")).unwrap().unwrap().contract_version, Some(2));
        for version in [None, Some("1"), Some("3"), Some("2.0")] {
            let error = settings(version).unwrap_err().to_string();
            assert!(error.contains("knows 2 here"), "{version:?}: {error}");
        }
    }

    #[test]
    fn hash_tag_is_the_braced_part() {
        assert_eq!(hash_tag("{orders}:events"), "orders");
        assert_eq!(hash_tag("a{b}c{d}"), "b");
        assert_eq!(hash_tag("{a{b}x"), "a{b");
    }

    #[test]
    fn hash_tag_is_the_whole_name_without_a_tag() {
        assert_eq!(hash_tag("notifications"), "notifications");
        assert_eq!(hash_tag("empty{}tag"), "empty{}tag");
        assert_eq!(hash_tag("open{only"), "open{only");
    }

    #[test]
    fn slots_match_redis() {
        // Values from CLUSTER KEYSLOT on a real server (tests/cluster.rs checks many more names against one).
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("notifications"), slot(&terminal_key("notifications", "g")));
    }

    #[test]
    fn counter_keys_name_the_stream() {
        assert_eq!(terminal_key("{orders}:events", "billing"), "{orders}:pelican:{orders}:events:billing:terminal");
        assert_ne!(terminal_key("{orders}:events", "billing"), terminal_key("{orders}:refunds", "billing"));
        assert_eq!(totals_key("notifications", "notifier"), "{notifications}:pelican:notifications:notifier:totals");
        assert_eq!(bounds_key("{orders}:events"), "{orders}:pelican:{orders}:events:bounds");
        assert_eq!(rejected_key("jobs"), "{jobs}:pelican:jobs:rejected");
        assert_eq!(slot(&bounds_key("jobs")), slot("jobs"));
        assert_eq!(redrive_key("jobs:dlq", "apps", "r1"), "{jobs:dlq}:pelican:jobs:dlq:redrive:apps/r1");
        assert_eq!(slot(&redrive_key("{jobs}:dlq", "apps", "r1")), slot("{jobs}:dlq"));
    }

    #[test]
    fn a_topics_keys_live_in_its_slot_and_each_partition_has_a_tag_of_its_own() {
        assert_eq!(partition_stream("orders", 3), "{orders:3}");
        assert_eq!(members_key("orders", "billing"), "{orders}:pelican:orders:billing:members");
        assert_eq!(owners_key("orders", "billing"), "{orders}:pelican:orders:billing:owners");
        assert_eq!(epochs_key("orders", "billing"), "{orders}:pelican:orders:billing:epochs");
        assert_eq!(slot(&members_key("orders", "billing")), slot(&settings_key("orders", "billing")));
        assert_eq!(slot(&terminal_key(&partition_stream("orders", 3), "billing")), slot("{orders:3}"));
        assert_ne!(slot(&partition_stream("orders", 3)), slot(&partition_stream("refunds", 3)));
    }

    #[test]
    fn streams_with_a_stray_closing_brace_have_no_same_slot_keys() {
        for stream in ["notifications", "{orders}:events", "{a{b}x", "open{only", "x}{tag}"] {
            assert!(has_same_slot_keys(stream), "{stream}");
        }
        for stream in ["a}b", "jobs{}v2", "}"] {
            assert!(!has_same_slot_keys(stream), "{stream}");
        }
    }
}
