-- Agree, on the server, on a stream's window of idempotent production, whatever each policy calls the server.
--
-- KEYS[1] the stream       KEYS[2] {T}:pelican:<stream>:idempotence: policy uid -> "<seconds> <maxSize> <ms>", the
--         window each policy of the stream declares and when it last said so (by the server's clock)
-- ARGV[1] the policy's uid  ARGV[2] its window's duration (s)  ARGV[3] its window's size (message ids per producer)
-- ARGV[4] how long a declaration counts without being said again (ms)
-- ARGV[5] most declarations read (policies of one stream); past that, that many of them are counted
--
-- Returns {seconds, maxSize, set}: the window in force, the longest duration and the largest size over the
-- declarations that count; set is 1 when this call ran XCFGSET to put it in place, 0 when the server had it.
--
-- Two policies of one stream that name its server differently (a RedisServer and a URL, two host names) cannot
-- find each other in Kubernetes; each declaring its own window would XCFGSET it at every reconcile, each time
-- clearing the server's record of producers and message ids, and retried publishes would duplicate. Here they meet
-- on the server: every reconcile says its window, and XCFGSET runs only when the window in force differs from the
-- stream's (`XINFO STREAM` idmp-duration and idmp-maxsize).
--
-- Invariant: XCFGSET runs only when the stream's window differs from the agreed one; a declaration not said again
-- within ARGV[4] (a deleted policy whose cleanup did not reach the server) stops counting and is removed.
-- Cost: one XINFO STREAM, and at most ARGV[5] fields of the hash read (one per policy of the stream).
local stream, declared = KEYS[1], KEYS[2]
local uid, seconds, max_size = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lasts, most = tonumber(ARGV[4]), tonumber(ARGV[5])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('HSET', declared, uid, string.format('%d %d %d', seconds, max_size, now))
-- At most ARGV[5] of them, all when there are no more (HRANDFIELD with a positive count: distinct fields).
local fields = redis.call('HRANDFIELD', declared, most, 'WITHVALUES')
for i = 1, #fields, 2 do
  local s, m, at = string.match(fields[i + 1], '^(%d+) (%d+) (%d+)$')
  if not s or now - tonumber(at) > lasts then
    redis.call('HDEL', declared, fields[i])
  else
    seconds, max_size = math.max(seconds, tonumber(s)), math.max(max_size, tonumber(m))
  end
end

local info = redis.call('XINFO', 'STREAM', stream)
local current = {}
for i = 1, #info, 2 do current[info[i]] = info[i + 1] end
if tonumber(current['idmp-duration']) == seconds and tonumber(current['idmp-maxsize']) == max_size then
  return {seconds, max_size, 0}
end
redis.call('XCFGSET', stream, 'IDMP-DURATION', seconds, 'IDMP-MAXSIZE', max_size)
return {seconds, max_size, 1}
