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
/// the new owner gets [`HANDOVER_GRACE`] to take it up before it is handed over (and counted) again; removed when
/// the entry leaves the PEL.
pub fn handovers_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{stream}:{group}:handovers", hash_tag(stream))
}

/// How long an entry `Reassign` handed over is left to its new owner: twice the SDK's `pel_check_interval` (30 s),
/// so an SDK worker always looks at its PEL before the entry could be handed over again.
pub const HANDOVER_GRACE: std::time::Duration = std::time::Duration::from_secs(60);

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

impl WorkerSettings {
    /// The settings a hash holds, when it holds the first three as numbers.
    pub fn from_fields(hash: &std::collections::BTreeMap<String, String>) -> Option<WorkerSettings> {
        let field = |name: &str| hash.get(name)?.parse::<u64>().ok();
        Some(WorkerSettings {
            min_idle_ms: field("minIdleMs")?,
            retry_after_ms: field("retryAfterMs")?,
            max_deliveries: u32::try_from(field("maxDeliveries")?).ok()?,
            contract_version: field("contractVersion").and_then(|v| u32::try_from(v).ok()),
        })
    }

    /// The contract the publishing operator speaks, when this build knows it; else an error that names both
    /// versions and what to do.
    pub fn check_contract(&self) -> Result<(), String> {
        match self.contract_version.unwrap_or(1) {
            CONTRACT_VERSION => Ok(()),
            other => Err(format!(
                "the operator speaks worker contract {other}, this SDK knows {CONTRACT_VERSION}: upgrade the SDK \
                 (contract/README.md says what changed)"
            )),
        }
    }
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

    #[test]
    fn a_contract_version_this_build_does_not_know_is_refused_by_name() {
        let mut hash: std::collections::BTreeMap<String, String> =
            [("minIdleMs", "3000"), ("retryAfterMs", "3000"), ("maxDeliveries", "3")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
        let unversioned = WorkerSettings::from_fields(&hash).unwrap();
        assert_eq!(unversioned.check_contract(), Ok(()), "an older operator's hash is version 1");
        hash.insert("contractVersion".into(), "2".into());
        let error = WorkerSettings::from_fields(&hash).unwrap().check_contract().unwrap_err();
        assert!(error.contains("contract 2") && error.contains("knows 1") && error.contains("upgrade"), "{error}");
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
    fn streams_with_a_stray_closing_brace_have_no_same_slot_keys() {
        for stream in ["notifications", "{orders}:events", "{a{b}x", "open{only", "x}{tag}"] {
            assert!(has_same_slot_keys(stream), "{stream}");
        }
        for stream in ["a}b", "jobs{}v2", "}"] {
            assert!(!has_same_slot_keys(stream), "{stream}");
        }
    }
}
