-- Lease: keep the entries a worker is still handling from looking idle, so the operator's pass never takes them.
--
-- KEYS[1] source stream
-- ARGV[1] group            ARGV[2] the worker's consumer name    ARGV[3..] entry ids (the caller sends at most 100)
--
-- Returns the ids that were extended; an id missing from the reply is no longer this consumer's (acknowledged,
-- requeued, dead-lettered or handed to another consumer by the operator's pass) and was left alone.
-- Invariant: the delivery count of every entry stays as it was (XCLAIM ... JUSTID without RETRYCOUNT); only the
-- consumer's own pending entries are touched, so a lease never takes back what the pass gave to someone else. One
-- XPENDING and one XCLAIM per id: a call costs what its ids cost.
local stream, group, consumer = KEYS[1], ARGV[1], ARGV[2]
local extended = {}
for i = 3, #ARGV do
  local id = ARGV[i]
  if redis.call('XPENDING', stream, group, id, id, 1, consumer)[1] then
    redis.call('XCLAIM', stream, group, consumer, 0, id, 'JUSTID')
    extended[#extended + 1] = id
  end
end
return extended
