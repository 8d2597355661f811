//! Pages of a stream read by bytes, not by count: how many entries the next `XRANGE` asks for.

use redis::streams::StreamId;

/// What a field costs beyond its bytes, as the scripts charge it (`FIELD_COST` in `src/jobs/scripts/*.lua`): a
/// field costs the server about what 512 bytes of its value do, so an entry of thousands of empty fields is not free.
pub const FIELD_COST: usize = 512;

/// Bytes one page read outside a script may weigh: a read of 256 entries of a megabyte held the server 163 ms.
pub const PAGE_BYTES: usize = 1 << 20;

/// How many entries the next read of a walk asks for: as many as [`PAGE_BYTES`] hold at the size the walk has seen
/// so far (each field weighed [`FIELD_COST`] bytes beyond its length), at most `max`, and one until a size was seen.
#[derive(Debug)]
pub struct Pager {
    max: usize,
    weight: usize,
    entries: usize,
}

impl Pager {
    pub fn new(max: usize) -> Pager {
        Pager { max: max.max(1), weight: 0, entries: 0 }
    }

    /// The count for the next read.
    pub fn count(&self) -> usize {
        if self.entries == 0 {
            return 1;
        }
        let average = (self.weight / self.entries).max(1);
        (PAGE_BYTES / average).clamp(1, self.max)
    }

    /// Learns the size of the entries a read returned.
    pub fn saw(&mut self, entries: &[StreamId]) {
        for entry in entries {
            self.entries += 1;
            self.weight +=
                entry.id.len() + entry.map.iter().map(|(k, v)| k.len() + weigh(v) + 2 * FIELD_COST).sum::<usize>();
        }
    }
}

fn weigh(value: &redis::Value) -> usize {
    match value {
        redis::Value::BulkString(bytes) => bytes.len(),
        redis::Value::SimpleString(text) => text.len(),
        _ => 8,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(fields: usize, value_len: usize) -> StreamId {
        let map = (0..fields).map(|i| (format!("f{i}"), redis::Value::BulkString(vec![b'x'; value_len]))).collect();
        StreamId { id: "1-0".into(), map, ..Default::default() }
    }

    #[test]
    fn one_entry_first_then_as_many_as_a_page_of_bytes_holds() {
        let mut pager = Pager::new(1000);
        assert_eq!(pager.count(), 1);
        pager.saw(&[entry(1, 1 << 20)]);
        assert_eq!(pager.count(), 1, "entries of a megabyte: one a page");
        let mut small = Pager::new(100);
        small.saw(&[entry(2, 10)]);
        assert_eq!(small.count(), 100, "small entries: the most a page may hold");
    }

    #[test]
    fn empty_fields_weigh_what_they_cost() {
        let mut pager = Pager::new(1_000_000);
        pager.saw(&[entry(2000, 0)]);
        // 2,000 empty fields: 2 MB of weight, one a page; counted by bytes alone, about 170 a page.
        assert_eq!(pager.count(), 1);
    }
}
