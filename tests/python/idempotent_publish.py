"""A producer in redis-py publishing idempotently through bounded_publish.lua (`IDMP <producer> <message>` before the
fields), whose first publish times out while the server is busy (another client's DEBUG SLEEP): the server still
writes it once the sleep ends, and the producer, which cannot tell, publishes the same message five times more.

    python3 idempotent_publish.py URL STREAM PRODUCER MESSAGE SCRIPT

PRODUCER `-` publishes without IDMP: the baseline, where every retry adds a duplicate.

prints `timeout` for the first publish, then `id <entry id>` for each retry, then `length <XLEN>`.
"""
import sys

import redis

url, stream, producer, message, script = sys.argv[1:6]
keys = [stream, "{%s}:pelican:%s:bounds" % (stream, stream), "{%s}:pelican:%s:rejected" % (stream, stream)]
args = (["IDMP", producer, message] if producer != "-" else []) + ["order", message]
r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=0.3)
publish = r.register_script(open(script).read())
r.script_load(publish.script)  # a producer that has been publishing: the server knows the script
# The server asleep for 3 s: DEBUG SLEEP sent without waiting for its reply, then a PING that times out says the
# sleep has begun, so the publish surely arrives while the server sleeps.
admin = redis.Redis.from_url(url)
admin.connection_pool.get_connection().send_command("DEBUG", "SLEEP", "3")
while True:
    try:
        redis.Redis.from_url(url, socket_timeout=0.05).ping()
    except redis.TimeoutError:
        break
try:
    publish(keys=keys, args=args)
    print("written before the timeout", flush=True)
except redis.TimeoutError:
    print("timeout", flush=True)
redis.Redis.from_url(url).ping()  # the producer backs off until the server answers again
for _ in range(5):
    print("id", publish(keys=keys, args=args), flush=True)
print("length", redis.Redis.from_url(url).xlen(stream), flush=True)
