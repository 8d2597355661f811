//! What a test reads back from a server: entries, the PEL, the groups, and the failover ledger.

use super::*;

/// An entry as the server stores it: id and fields in order, as raw bytes.
pub type RawEntry = (String, Vec<(Vec<u8>, Vec<u8>)>);

/// All entries of a stream, raw.
pub fn xrange(conn: &mut impl redis::ConnectionLike, stream: &str) -> Vec<RawEntry> {
    let reply: Vec<(String, Vec<Vec<u8>>)> = redis::cmd("XRANGE").arg(stream).arg("-").arg("+").query(conn).unwrap();
    reply
        .into_iter()
        .map(|(id, flat)| {
            let pairs = flat.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
            (id, pairs)
        })
        .collect()
}

/// The ids of up to `count` entries from `from` (`-`, an id, or `(` and an id), one XRANGE.
pub fn xrange_page(conn: &mut redis::Connection, stream: &str, from: &str, count: usize) -> Vec<String> {
    let reply: Vec<(String, Vec<Vec<u8>>)> =
        redis::cmd("XRANGE").arg(stream).arg(from).arg("+").arg("COUNT").arg(count).query(conn).unwrap();
    reply.into_iter().map(|(id, _)| id).collect()
}

/// (id, consumer, idle ms, deliveries) of every PEL entry.
pub fn pel(conn: &mut redis::Connection, stream: &str, group: &str) -> Vec<(String, String, i64, i64)> {
    redis::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(1_000_000).query(conn).unwrap()
}

/// A group as `XINFO GROUPS` shows it: field -> value.
pub type GroupInfo = HashMap<String, redis::Value>;

/// `XINFO GROUPS` of a stream; none when the stream does not exist.
pub fn xinfo_groups(conn: &mut impl redis::ConnectionLike, stream: &str) -> Vec<GroupInfo> {
    let groups: Vec<redis::Value> = redis::cmd("XINFO").arg("GROUPS").arg(stream).query(conn).unwrap_or_default();
    groups.into_iter().map(|g| redis::from_redis_value(g).unwrap()).collect()
}

/// One field of a group of `XINFO GROUPS` (`name`, `pending`, `lag`, `last-delivered-id`, ...).
pub fn group_field<T: redis::FromRedisValue>(group: &GroupInfo, field: &str) -> T {
    redis::from_redis_value(group[field].clone()).unwrap()
}

/// The names of a stream's groups.
pub fn group_names(conn: &mut impl redis::ConnectionLike, stream: &str) -> Vec<String> {
    xinfo_groups(conn, stream).iter().map(|g| group_field(g, "name")).collect()
}

/// XREADGROUP `>` for one consumer; returns the ids delivered.
pub fn read_new(conn: &mut redis::Connection, stream: &str, group: &str, consumer: &str, count: usize) -> Vec<String> {
    // Raw reply: [[stream, [[id, [field, value, ...]], ...]]]; fields may be any bytes.
    type Reply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;
    let reply: Reply = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg(group)
        .arg(consumer)
        .arg("COUNT")
        .arg(count)
        .arg("STREAMS")
        .arg(stream)
        .arg(">")
        .query(conn)
        .unwrap();
    reply.into_iter().flatten().flat_map(|(_, entries)| entries.into_iter().map(|(id, _)| id)).collect()
}

/// The value of a field in a raw entry (the last one when the name repeats).
pub fn field<'a>(entry: &'a RawEntry, name: &str) -> Option<&'a [u8]> {
    entry.1.iter().rev().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| v.as_slice())
}

/// Entries as (id, value of field `n`), from a raw reply of XRANGE or one stream of XREADGROUP.
pub fn entries_n(raw: Vec<(String, Vec<Vec<u8>>)>) -> Vec<(String, Option<u64>)> {
    raw.into_iter()
        .map(|(id, flat)| {
            let n = flat.chunks(2).find(|p| p[0] == b"n").and_then(|p| String::from_utf8_lossy(&p[1]).parse().ok());
            (id, n)
        })
        .collect()
}

/// The failover ledger: on the server now in charge, every message of `stream` (field `n`) is exactly once
/// dead-lettered and acknowledged, or not acknowledged (pending, or not delivered yet) and not in `dlq`; no dead
/// letter without its message. Returns (dead-lettered, not acknowledged). Only the dead-lettering script
/// acknowledges in these tests. The four reads are one MULTI/EXEC: the operator may still be dead-lettering, and a
/// message moved between reading the dead-letter stream and reading the PEL would look acknowledged but never
/// dead-lettered.
pub fn failover_ledger(conn: &mut impl redis::ConnectionLike, stream: &str, dlq: &str, group: &str) -> (usize, usize) {
    type Entries = Vec<(String, Vec<Vec<u8>>)>;
    type Pel = Vec<(String, String, i64, i64)>;
    type Groups = Vec<HashMap<String, redis::Value>>;
    let (dead_entries, pending, groups, entries): (Entries, Pel, Groups, Entries) = redis::pipe()
        .atomic()
        .cmd("XRANGE")
        .arg(dlq)
        .arg("-")
        .arg("+")
        .cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(1_000_000)
        .cmd("XINFO")
        .arg("GROUPS")
        .arg(stream)
        .cmd("XRANGE")
        .arg(stream)
        .arg("-")
        .arg("+")
        .query(conn)
        .unwrap();
    let n_of = |flat: &[Vec<u8>]| -> String {
        flat.chunks(2).find(|p| p[0] == b"n").map(|p| String::from_utf8_lossy(&p[1]).into_owned()).expect("field n")
    };
    let mut dead: HashMap<String, usize> = HashMap::new();
    for (_, flat) in &dead_entries {
        *dead.entry(n_of(flat)).or_default() += 1;
    }
    let pending: std::collections::HashSet<String> = pending.into_iter().map(|p| p.0).collect();
    let group_info = groups.iter().find(|g| g["name"] == redis::Value::BulkString(group.as_bytes().to_vec())).unwrap();
    let last_delivered: String = redis::from_redis_value_ref(&group_info["last-delivered-id"]).unwrap();
    let id_key = |id: &str| {
        let (ms, seq) = id.split_once('-').unwrap();
        (ms.parse::<u64>().unwrap(), seq.parse::<u64>().unwrap())
    };
    let (mut acknowledged, mut open) = (0, 0);
    let mut seen = std::collections::HashSet::new();
    for (id, flat) in entries {
        let n = n_of(&flat);
        assert!(seen.insert(n.clone()), "message {n} twice in the stream");
        let in_dlq = dead.get(&n).copied().unwrap_or(0);
        if id_key(&id) <= id_key(&last_delivered) && !pending.contains(&id) {
            acknowledged += 1;
            assert_eq!(in_dlq, 1, "message {n} acknowledged but {in_dlq} times in the dead-letter stream");
        } else {
            open += 1;
            assert_eq!(in_dlq, 0, "message {n} not acknowledged but {in_dlq} times in the dead-letter stream");
        }
    }
    assert_eq!(dead_entries.len(), acknowledged, "no dead letter without its acknowledged message");
    (acknowledged, open)
}

/// Waits until the operator has moved at least `at_least` entries into `dead_letter`, looking every few
/// milliseconds (a pass moves tens of thousands a second: `wait_for`'s 200 ms could miss the whole move on a busy
/// machine), and returns how many it found; for tests that kill a server while a pass is under way.
pub fn dead_lettering_under_way(conn: &mut impl redis::ConnectionLike, dead_letter: &str, at_least: usize) -> usize {
    let start = std::time::Instant::now();
    loop {
        let len: usize = redis::cmd("XLEN").arg(dead_letter).query(conn).unwrap();
        if len >= at_least {
            return len;
        }
        assert!(start.elapsed() < std::time::Duration::from_secs(60), "no dead-lettering within 60 s: {len} moved");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}
