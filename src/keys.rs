//! Pelican's Redis key names (SPEC section 4). Shared by the operator and the worker SDK.

/// The content of the stream's hash tag if its name has one (`{orders}:events` -> `orders`), else the whole name.
/// Redis hashes only the tag, so keys built from it land in the stream's slot.
pub fn hash_tag(stream: &str) -> &str {
    if let Some(open) = stream.find('{')
        && let Some(len) = stream[open + 1..].find('}')
        && len > 0
    {
        return &stream[open + 1..open + 1 + len];
    }
    stream
}

/// The Redis Cluster hash slot of a key: CRC16 of its hash tag (or whole name), modulo 16384.
pub fn slot(key: &str) -> u16 {
    crc16::State::<crc16::XMODEM>::calculate(hash_tag(key).as_bytes()) % 16384
}

/// `{T}:pelican:<group>:terminal`: reason code -> messages ended as terminal.
pub fn terminal_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{group}:terminal", hash_tag(stream))
}

/// `{T}:pelican:<group>:totals`: the operator's own counters.
pub fn totals_key(stream: &str, group: &str) -> String {
    format!("{{{}}}:pelican:{group}:totals", hash_tag(stream))
}

/// The consumer name the operator's reclaim pass uses; kept out of counts and metrics.
pub const OPERATOR_CONSUMER: &str = "pelican-operator";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tag_is_the_braced_part() {
        assert_eq!(hash_tag("{orders}:events"), "orders");
        assert_eq!(hash_tag("a{b}c{d}"), "b");
    }

    #[test]
    fn hash_tag_is_the_whole_name_without_a_tag() {
        assert_eq!(hash_tag("notifications"), "notifications");
        assert_eq!(hash_tag("empty{}tag"), "empty{}tag");
        assert_eq!(hash_tag("open{only"), "open{only");
    }

    #[test]
    fn slots_match_redis() {
        // Values from CLUSTER KEYSLOT on a real server.
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("notifications"), slot(&terminal_key("notifications", "g")));
    }

    #[test]
    fn counter_keys_share_the_stream_slot() {
        assert_eq!(terminal_key("{orders}:events", "billing"), "{orders}:pelican:billing:terminal");
        assert_eq!(totals_key("notifications", "notifier"), "{notifications}:pelican:notifier:totals");
    }
}
