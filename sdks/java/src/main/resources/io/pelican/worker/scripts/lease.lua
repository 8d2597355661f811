-- Lease: keep the entries a worker is still handling from looking idle, so the operator's pass never takes them,
-- and say that the worker is alive.
--
-- KEYS[1] source stream    KEYS[2] the group's heartbeats hash ({T}:pelican:<stream>:<group>:consumers)
-- ARGV[1] group            ARGV[2] the worker's consumer name    ARGV[3..] entry ids (the caller sends at most 100)
--
-- Called at every lease tick, also with no ids: the heartbeat (consumer -> the server's time in ms) is what tells
-- the operator's `strategy: Reassign` that a consumer's process is alive. Redis' own idle time of a consumer cannot:
-- the pass's own XCLAIM to a consumer resets it, and a server loading its AOF starts it again.
--
-- Returns the ids that were extended; an id missing from the reply is no longer this consumer's (acknowledged,
-- requeued, dead-lettered or handed to another consumer by the operator's pass) and was left alone.
-- Invariant: the delivery count of every entry stays as it was (XCLAIM ... JUSTID without RETRYCOUNT); only the
-- consumer's own pending entries are touched, so a lease never takes back what the pass gave to someone else. The
-- heartbeat (TIME, then HSET) is written with pcall: an ACL written before it existed refuses it, and the leases
-- still hold (the pass then sees no live consumer and requeues instead of handing over). One HSET, then one XPENDING and one XCLAIM per
-- id: a call costs what its ids cost.
local stream, heartbeats, group, consumer = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local now = redis.pcall('TIME')
if now[1] then
  redis.pcall('HSET', heartbeats, consumer, string.format('%d', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
end
local extended = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('XPENDING', stream, group, id, id, 1, consumer)[1] then
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
    extended[#extended + 1] = id
  end
end
return extended
