"""A worker that claims by itself, as many tutorials write one: it reads new entries, fails them (never ACKs), and
every second takes back with XAUTOCLAIM whatever has been idle 1 s, each claim a delivery. Pelican's pass must still
dead-letter a message it keeps failing once its deliveries pass the policy's maxDeliveries.

    python3 autoclaim.py URL STREAM GROUP CONSUMER SECONDS

prints `delivery <entry id>` for every read or claim, for SECONDS seconds.
"""
import sys
import time

import redis

url, stream, group, consumer, seconds = sys.argv[1:6]
r = redis.Redis.from_url(url, decode_responses=True)
deadline = time.monotonic() + float(seconds)
while time.monotonic() < deadline:
    for _stream, entries in r.xreadgroup(group, consumer, {stream: ">"}, count=10, block=100) or []:
        for entry_id, _fields in entries:
            print("delivery", entry_id, flush=True)
    _next, claimed, _deleted = r.xautoclaim(stream, group, consumer, 1000, "0-0", count=10)
    for entry_id, _fields in claimed:
        print("delivery", entry_id, flush=True)
    time.sleep(1)
