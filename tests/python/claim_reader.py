"""A worker that reads with XREADGROUP ... CLAIM <min-idle> (Redis 8.4+; redis-py's claim_min_idle_time): every read
first takes back entries of the group idle at least MIN_IDLE_MS, whoever holds them, then reads new ones. MODE `fail`
never acknowledges (a poison message: Pelican's pass must still dead-letter it once its deliveries pass the policy's
maxDeliveries); MODE `ack` acknowledges each entry it gets (it shares the work with Pelican's requeue pass).

    python3 claim_reader.py URL STREAM GROUP CONSUMER SECONDS MIN_IDLE_MS MODE

prints `delivery <entry id> <field n> <deliveries before this one>` for every entry a read returns, for SECONDS seconds.
"""
import sys
import time

import redis

url, stream, group, consumer, seconds, min_idle, mode = sys.argv[1:8]
r = redis.Redis.from_url(url, decode_responses=True)
deadline = time.monotonic() + float(seconds)
while time.monotonic() < deadline:
    reply = r.xreadgroup(group, consumer, {stream: ">"}, count=10, block=100, claim_min_idle_time=int(min_idle))
    for _stream, entries in reply or []:
        # With CLAIM each entry is [id, fields, idle ms, deliveries before this one] (0 and 0 for a new entry).
        for entry in entries:
            entry_id, fields = entry[0], entry[1]
            deliveries = entry[3] if len(entry) > 3 else 0
            print("delivery", entry_id, (fields or {}).get("n"), deliveries, flush=True)
            if mode == "ack":
                r.xack(stream, group, entry_id)
    time.sleep(0.2)
