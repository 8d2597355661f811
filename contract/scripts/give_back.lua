-- Give back: hand entries of a worker back to the operator's pass now, instead of after `minIdle`.
--
-- KEYS[1] source stream
-- ARGV[1] group            ARGV[2] the worker's consumer name
-- ARGV[3] the idle time (ms) to give each entry: the group's `retryAfterMs` (every retry threshold allows it: the
--         next pass takes the entry) or its `minIdleMs` (the pass takes it as it would a failure, under the backoff)
-- ARGV[4] 1: the delivery being given back does not count (a shutdown stopped it, the handler never finished);
--         0: it counts (the handler asked for a retry)
-- ARGV[5..] entry ids (the caller sends at most 100)
--
-- Returns how many entries were given back; an id no longer this consumer's is left alone.
-- Invariant: the entry stays in the PEL with the same owner (the operator's pass moves it, with its fields and its
-- last error); its count is lowered by one only for a delivery that did not count, never below 0. One XPENDING and
-- one XCLAIM per id.
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local idle, uncount = ARGV[3], ARGV[4] == '1'
local given = 0
for i = 5, #ARGV do
  local id = ARGV[i]
  local pending = redis.call('XPENDING', stream, group, id, id, 1, consumer)[1]
  if pending then
    local count = pending[4]
    if uncount and count > 0 then count = count - 1 end
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'IDLE', idle, 'RETRYCOUNT', count, 'JUSTID')
    given = given + 1
  end
end
return given
