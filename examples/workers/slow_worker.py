"""A redis-py worker whose handler may be slower than the group's minIdle, kept from looking abandoned with the
lease call Pelican documents: `contract/scripts/lease.lua` (the owner's `XCLAIM ... JUSTID` on the messages it is
still handling, only those still its own: idle back to 0, the delivery count unchanged), every third of the
`minIdleMs` the operator publishes in `{T}:pelican:<stream>:<group>:settings` (at least every 10 s), the settings
read again at every lease so that a lowered minIdle is followed. A library does all this and the rest of the
contract: sdks/python.

    python3 slow_worker.py redis://127.0.0.1:6379 '{orders}:events' billing worker-1 12 100

handles messages (each takes HANDLE_SECONDS, here 12) until it handled COUNT (here 100) or ran 120 s, printing
`handled <entry id>` for every run of the handler.
"""
import os
import sys
import threading
import time

import redis


def hash_tag(key):
    """The part of a key Redis Cluster hashes: the first non-empty {...}, else the whole key."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            return key[start + 1:end]
    return key


def settings_key(stream, group):
    return "{%s}:pelican:%s:%s:settings" % (hash_tag(stream), stream, group)


def main():
    url, stream, group, consumer, seconds, count = sys.argv[1:7]
    r = redis.Redis.from_url(url, decode_responses=True)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
    with open(os.path.join(root, "contract", "scripts", "lease.lua")) as script:
        lease = r.register_script(script.read())

    def lease_interval():
        # Three leases per minIdle, at least every 10 s; every second when no policy publishes settings.
        settings = r.hgetall(settings_key(stream, group))
        if "minIdleMs" not in settings:
            return 1.0
        return min(int(settings["minIdleMs"]) / 3 / 1000, 10.0)

    every = lease_interval()
    in_flight, lock, handled = set(), threading.Lock(), []

    def handle(entry_id, fields):
        time.sleep(float(seconds))  # the slow part of the handler
        r.xack(stream, group, entry_id)
        with lock:
            in_flight.discard(entry_id)
            handled.append(entry_id)
            print("handled", entry_id, flush=True)

    deadline, last_lease = time.monotonic() + 120, time.monotonic()
    while len(handled) < int(count) and time.monotonic() < deadline:
        for _stream, entries in r.xreadgroup(group, consumer, {stream: ">"}, count=16, block=100) or []:
            for entry_id, fields in entries:
                with lock:
                    in_flight.add(entry_id)
                threading.Thread(target=handle, args=(entry_id, fields), daemon=True).start()
        if time.monotonic() - last_lease >= every:
            last_lease = time.monotonic()
            with lock:
                ids = list(in_flight)
            # The lease: Pelican's pass never takes an entry whose idle time stays below minIdle. Also with no ids:
            # the call is the worker's heartbeat (`strategy: Reassign` hands entries only to workers that beat).
            lease(keys=[stream, settings_key(stream, group).removesuffix(":settings") + ":consumers"],
                  args=[group, consumer, *ids])
            every = lease_interval()


main()
