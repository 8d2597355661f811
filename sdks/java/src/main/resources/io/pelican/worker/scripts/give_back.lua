-- Give back: hand entries of a worker back to the operator's pass now, instead of after `minIdle`.
--
-- KEYS[1] source stream
-- ARGV[1] group            ARGV[2] the worker's consumer name
-- ARGV[3] the idle time (ms) to give each entry: the group's `retryAfterMs` (every retry threshold allows it) or its
--         `minIdleMs` (the pass takes it as it would a failure, under the backoff)
-- ARGV[4] 1: a shutdown stopped the handler: the delivery does not count, and the entry is left without an owner
--         (consumer ''), as `XNACK ... SILENT` (Redis 8.8) leaves it: the next pass takes it whatever its idle time,
--         and never hands it back to the worker that is leaving;
--         0: the handler asked for a retry: the delivery counts, the entry stays with its owner, idle ARGV[3], and
--         the pass retries it under the policy's backoff
-- ARGV[5..] entry ids (the caller sends at most 100)
--
-- With ARGV[4] = 1 the worker is leaving: once its entries are given back, its consumer is deleted when it owns no
-- pending entry any more (called with no ids when nothing was left to give back). A consumer that just read looks
-- live for `minIdle`, and `strategy: Reassign` would hand entries to a worker that is gone.
--
-- Returns how many entries were given back; an id no longer this consumer's is left alone.
-- Invariant: only the caller's own pending entries are touched (the owner is checked here, in the same atomic call,
-- which XNACK cannot do: it takes no consumer), so a give-back never releases what the pass handed to another
-- worker; the entry stays in the PEL (the operator's pass moves it, with its fields and its last error); its count
-- is lowered by one only for a delivery that did not count, never below 0; a consumer is deleted only when it owns
-- nothing (XGROUP DELCONSUMER would drop its pending entries). One XPENDING and one XCLAIM per id, one XPENDING and
-- at most one delete for leaving.
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local idle, uncount = ARGV[3], ARGV[4] == '1'
local owner = uncount and '' or consumer
local given = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  local pending = redis.call('XPENDING', stream, group, id, id, 1, consumer)[1]
  if pending then
    local count = pending[4]
    if uncount and count > 0 then count = count - 1 end
    redis.call('XCLAIM', stream, group, owner, 0, id, 'IDLE', idle, 'RETRYCOUNT', count, 'JUSTID')
    given = given + 1
  end
end
if uncount and #redis.call('XPENDING', stream, group, '-', '+', 1, consumer) == 0 then
  redis.call('XGROUP', 'DELCONSUMER', stream, group, consumer)
end
return given
