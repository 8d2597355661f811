#!/usr/bin/env python3
"""What Pelican's keys cost a Redis or Valkey server in memory (issue 66), per item, for two message sizes.

What it builds, on the server at --url, under the hash tag {cap} (every key it writes starts with `{cap}`; it deletes
them when done, and refuses to start if one exists):

- a stream `{cap}:orders` of N entries `n <i> body <B bytes>` (B = 200 and 2,048: the application's own, for
  comparison);
- a group `workers` that has read them all (N pending entries, one consumer named as a worker Pod is);
- C consumers in the group (`XGROUP CREATECONSUMER`) and their heartbeats in `{cap}:pelican:{cap}:orders:workers:
  consumers` (consumer -> ms, as `lease.lua` writes them);
- the errors hash `{cap}:pelican:{cap}:orders:workers:errors`: pending id -> a 200-byte text, then the same ids with
  a 1,024-byte text (ERROR_TEXT_MAX, src/keys.rs: workers cut there, contract/README.md);
- a Requeue retry of each pending entry as `src/jobs/scripts/reclaim.lua` makes it: a copy at the tail with the
  original's fields plus `pelican-origin-id` and `pelican-deliveries`, then the original acknowledged (`XACK`), its
  error moved to the copy's id;
- N dead letters in `{cap}:orders:dead`, the original's fields plus Pelican's eight (`pelican-source-stream`,
  `-source-id`, `-origin-id`, `-group`, `-consumer`, `-deliveries`, `-reason`, `-dead-lettered-at`), and N more in
  `{cap}:orders:dead-err` with a ninth, `pelican-last-error` of 200 bytes;
- P groups' fixed keys (`:settings` as publish_settings.lua writes it, `:totals` and `:terminal` after a pass that
  moved, `:creator` (a policy uid), `:owner` (an install id, with a TTL)), on P streams of their own.

Each step is measured twice: the `used_memory` delta of `INFO memory` across it (what the allocator gave; it waits
for lazily freed objects first) and `MEMORY USAGE <key> SAMPLES 0` (the server's own estimate), both divided by the
count. Nobody else should write to the server meanwhile: start a private one.

    redis-server --port 18123 --save '' --appendonly no --daemonize yes
    PYTHONPATH=<redis-py> python3 benches/capacity.py --url redis://127.0.0.1:18123 [--url ...] [-n 100000]

With several --url it measures each server in turn and prints one table with a column per server: for each message
size, bytes per item, `used_memory` first, then `MEMORY USAGE` in brackets where a key's own estimate applies. Each
column names the server's allocator (`mem_allocator`): jemalloc rounds allocations up to its size classes, libc
malloc less, so the same server version differs by build.
Loops are bounded by -n (entries), -c (consumers) and -p (groups); writes go in pipelines of 1,000 commands.
"""

import argparse
import sys
import time

import redis

STREAM = "{cap}:orders"
DLQ = "{cap}:orders:dead"
DLQ_ERR = "{cap}:orders:dead-err"
GROUP = "workers"
# A consumer named as the SDK names it, after its Pod (a Deployment's).
POD = "orders-worker-5d8f7c9b6d-x7k2q"
ERROR_TEXT_MAX = 1024  # src/keys.rs
BATCH = 1000
POLICY_UID = "3f2b8c1e-9a4d-4e7b-8c21-5d6f0a9e1b47"
INSTALL_ID = "b7e41f02-6c3a-4d85-9f10-2a8e5c7d3b96"


def pkey(stream, group, suffix):
    """`{T}:pelican:<stream>:<group>:<suffix>` (src/keys.rs), T the stream's hash tag content."""
    open_ = stream.index("{")
    tag = stream[open_ + 1 : stream.index("}", open_)]
    return "{%s}:pelican:%s:%s:%s" % (tag, stream, group, suffix)


ERRORS = pkey(STREAM, GROUP, "errors")
CONSUMERS = pkey(STREAM, GROUP, "consumers")


def used_memory(r):
    while True:
        info = r.info("memory")
        if int(info.get("lazyfree_pending_objects", 0)) == 0:
            return int(info["used_memory"])
        time.sleep(0.01)


def usage(r, key):
    return r.execute_command("MEMORY", "USAGE", key, "SAMPLES", 0) or 0


def batched(r, items, write):
    """write(pipe, item) for each item, in pipelines of BATCH; returns the replies in order."""
    out = []
    for start in range(0, len(items), BATCH):
        pipe = r.pipeline(transaction=False)
        for item in items[start : start + BATCH]:
            write(pipe, item)
        out.extend(pipe.execute())
    return out


def text(size, seed):
    return (("%s:" % seed) + "x" * size)[:size]


def measure(r, n, consumers, groups, body_size):
    """Rows (name, used_memory bytes per item, MEMORY USAGE bytes per item or None) for one message size."""
    rows = []
    body = text(body_size, 7)
    step = {}

    def begin():
        step["before"] = used_memory(r)

    def end(name, count, key=None, key_before=0):
        per = (used_memory(r) - step["before"]) / count
        est = None if key is None else (usage(r, key) - key_before) / count
        rows.append((name, per, est))
        return per

    # The application's own entries.
    begin()
    ids = batched(r, list(range(n)), lambda p, i: p.xadd(STREAM, {"n": str(i), "body": body}))
    ids = [i.decode() if isinstance(i, bytes) else i for i in ids]
    index = {i: str(k) for k, i in enumerate(ids)}
    end("stream entry", n, STREAM)

    # The group reads them all: N pending entries of one consumer.
    stream_usage = usage(r, STREAM)
    r.xgroup_create(STREAM, GROUP, id="0")
    begin()
    read = 0
    while read < n:
        got = r.xreadgroup(GROUP, POD, {STREAM: ">"}, count=min(BATCH * 10, n - read))
        if not got:
            break
        read += len(got[0][1])
    assert read == n, read
    end("pending entry (PEL)", n, STREAM, stream_usage)

    # Consumers (each owning nothing) and their heartbeats.
    names = ["orders-worker-5d8f7c9b6d-%05d" % i for i in range(consumers)]
    stream_usage = usage(r, STREAM)
    begin()
    batched(r, names, lambda p, c: p.execute_command("XGROUP", "CREATECONSUMER", STREAM, GROUP, c))
    end("consumer", consumers, STREAM, stream_usage)
    now = str(int(time.time() * 1000))
    begin()
    batched(r, names, lambda p, c: p.hset(CONSUMERS, c, now))
    end("consumer's heartbeat (:consumers)", consumers, CONSUMERS)
    r.delete(CONSUMERS)
    batched(r, names, lambda p, c: p.execute_command("XGROUP", "DELCONSUMER", STREAM, GROUP, c))

    # The last error of each pending entry: 200 bytes, then the cap.
    begin()
    batched(r, ids, lambda p, i: p.hset(ERRORS, i, text(200, i)))
    end("last error, 200 bytes (:errors)", n, ERRORS)
    r.delete(ERRORS)
    begin()
    batched(r, ids, lambda p, i: p.hset(ERRORS, i, text(ERROR_TEXT_MAX, i)))
    end("last error, 1,024 bytes (the cap)", n, ERRORS)
    r.delete(ERRORS)
    batched(r, ids, lambda p, i: p.hset(ERRORS, i, text(200, i)))

    # A Requeue retry of each entry, as reclaim.lua's requeue() makes it (the copy first, the XACK after).
    stream_usage = usage(r, STREAM)
    begin()

    def requeue(p, i):
        p.xadd(STREAM, {"n": index[i], "body": body, "pelican-origin-id": i, "pelican-deliveries": "2"})

    copies = batched(r, ids, requeue)
    copies = [c.decode() if isinstance(c, bytes) else c for c in copies]
    end("Requeue: the copy", n, STREAM, stream_usage)
    stream_usage = usage(r, STREAM)
    begin()
    for start in range(0, n, BATCH):
        r.xack(STREAM, GROUP, *ids[start : start + BATCH])
    end("Requeue: XACK of the original (frees its PEL entry)", n, STREAM, stream_usage)
    errors_usage = usage(r, ERRORS)
    begin()

    def move_error(p, pair):
        p.hdel(ERRORS, pair[0])
        p.hset(ERRORS, pair[1], text(200, pair[0]))

    batched(r, list(zip(ids, copies)), move_error)
    end("Requeue: the error moved to the copy's id", n, ERRORS, errors_usage)

    # Dead letters, without and with the last error.
    def letter(key, i, error):
        fields = {
            "n": index[i],
            "body": body,
            "pelican-source-stream": STREAM,
            "pelican-source-id": i,
            "pelican-origin-id": i,
            "pelican-group": GROUP,
            "pelican-consumer": POD,
            "pelican-deliveries": "5",
            "pelican-reason": "MaxDeliveriesExceeded",
            "pelican-dead-lettered-at": str(int(time.time() * 1000)),
        }
        if error:
            fields["pelican-last-error"] = text(200, i)
        return lambda p: p.xadd(key, fields)

    begin()
    batched(r, ids, lambda p, i: letter(DLQ, i, False)(p))
    end("dead letter (Pelican's 8 fields)", n, DLQ)
    begin()
    batched(r, ids, lambda p, i: letter(DLQ_ERR, i, True)(p))
    end("dead letter + 200-byte pelican-last-error", n, DLQ_ERR)
    r.delete(STREAM, DLQ, DLQ_ERR, ERRORS)

    # One group's fixed keys, on `groups` streams of their own (the streams and groups are not counted).
    streams = ["{cap-%d}:orders" % g for g in range(groups)]
    batched(r, streams, lambda p, s: p.xgroup_create(s, GROUP, id="$", mkstream=True))
    fixed = [
        ("settings", lambda p, s, k: p.hset(k, mapping={
            "minIdleMs": "30000", "retryAfterMs": "30000", "maxDeliveries": "5", "contractVersion": "1"})),
        ("totals", lambda p, s, k: p.hset(k, mapping={
            "requeued": "1204", "reassigned": "0", "deadLettered": "17", "payloadDeleted": "0",
            "deadLetterEvicted": "0"})),
        ("terminal", lambda p, s, k: p.hset(k, mapping={"MaxDeliveriesExceeded": "15", "NackedFatal": "2"})),
        ("creator", lambda p, s, k: p.set(k, POLICY_UID)),
        ("owner", lambda p, s, k: p.set(k, INSTALL_ID, px=60000)),
    ]
    for suffix, write in fixed:
        keys = [pkey(s, GROUP, suffix) for s in streams]
        begin()
        batched(r, list(zip(streams, keys)), lambda p, sk: write(p, sk[0], sk[1]))
        per_usage = sum(usage(r, k) for k in keys[:100]) / min(100, len(keys))
        per = (used_memory(r) - step["before"]) / groups
        rows.append(("group's :%s" % suffix, per, per_usage))
    for start in range(0, groups, 100):
        chunk = streams[start : start + 100]
        r.delete(*chunk, *[pkey(s, GROUP, x) for s in chunk for x, _ in fixed])
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", action="append", required=True, help="a server nobody else writes to (repeatable)")
    ap.add_argument("-n", type=int, default=100_000, help="entries per step (default 100,000)")
    ap.add_argument("-c", type=int, default=10_000, help="consumers (default 10,000)")
    ap.add_argument("-p", type=int, default=1_000, help="groups for the fixed keys (default 1,000)")
    args = ap.parse_args()
    if not (0 < args.n <= 1_000_000 and 0 < args.c <= 100_000 and 0 < args.p <= 100_000):
        sys.exit("-n at most 1,000,000, -c and -p at most 100,000")

    columns = []
    table = {}
    for url in args.url:
        r = redis.Redis.from_url(url)
        if next(r.scan_iter(match="{cap*", count=1000), None) is not None:
            sys.exit("%s holds {cap...} keys already: use a server of its own" % url)
        info = r.info("server")
        name = "%s %s (%s)" % ("Valkey" if "valkey_version" in info else "Redis",
                               info.get("valkey_version", info["redis_version"]),
                               r.info("memory").get("mem_allocator", "?"))
        columns.append(name)
        for size in (200, 2048):
            print("%s: %d-byte body..." % (name, size), file=sys.stderr)
            for what, per, est in measure(r, args.n, args.c, args.p, size):
                table.setdefault((size, what), {})[name] = (per, est)

    print("bytes per item: used_memory delta / count [MEMORY USAGE delta / count]")
    print("N = %d entries, %d consumers, %d groups" % (args.n, args.c, args.p))
    width = 52
    print("| %-*s | %s |" % (width, "item", " | ".join(columns)))
    print("| %s | %s |" % ("-" * width, " | ".join("---" for _ in columns)))
    for size in (200, 2048):
        print("| %-*s | %s |" % (width, "**%d-byte body**" % size, " | ".join("" for _ in columns)))
        for (s, what), per_server in table.items():
            if s != size:
                continue
            cells = []
            for c in columns:
                per, est = per_server[c]
                cells.append("%.0f" % per + ("" if est is None else " [%.0f]" % est))
            print("| %-*s | %s |" % (width, what, " | ".join(cells)))


if __name__ == "__main__":
    main()
