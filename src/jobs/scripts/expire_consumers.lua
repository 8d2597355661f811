-- Delete the named consumers of a group that own no pending entry.
--
-- KEYS[1] source stream    KEYS[2] totals hash
-- ARGV[1] group            ARGV[2..] consumer names (at most EXPIRE_BATCH of them: the caller picked them from
--                          XINFO CONSUMERS as idle at least `expireAfter` and owning nothing, or as consumers whose
--                          Pod is gone, `spec.consumers.pods`; both are counted as `consumersExpired`)
--
-- Returns the number of consumers deleted.
--
-- Invariant: no pending entry is ever destroyed. XGROUP DELCONSUMER silently drops the consumer's pending
-- entries, so the "owns nothing" check (XPENDING of that consumer, one entry) and the delete happen in this one
-- script, where no client can interleave. A consumer that read again since the caller listed it owns what it read
-- and stays; one that tried to read and found nothing owns nothing and goes, which costs it nothing (a read
-- creates it again). Cost: one XPENDING and at most one delete per name, whatever the group's size.
--
-- "Idle" is XINFO CONSUMERS `idle`, the time since the consumer's last attempted interaction (a blocking
-- XREADGROUP counts when it is issued). Not `inactive` (Redis 7.2+ / Valkey), the time since its last *successful*
-- read: a healthy worker blocking on a quiet stream reads nothing for hours, and deleting it every `expireAfter`
-- would churn its name and its metrics. A worker that blocks without a timeout (BLOCK 0) looks idle while it
-- waits, so expireAfter must exceed the longest block.

local src, totals = KEYS[1], KEYS[2]
local group = ARGV[1]

local t = redis.call('TYPE', src)['ok']
if t ~= 'stream' then return 0 end
local tt = redis.call('TYPE', totals)['ok']
if tt ~= 'none' and tt ~= 'hash' then
  return redis.error_reply('WRONGTYPE key ' .. totals .. ' holds a ' .. tt .. ', not a hash')
end

local deleted = 0
for i = 2, #ARGV do
  if #redis.call('XPENDING', src, group, '-', '+', 1, ARGV[i]) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', src, group, ARGV[i])
    deleted = deleted + 1
  end
end
if deleted > 0 then
  -- Counting cannot fail after the deletes: a field that holds no integer starts again from this count.
  local v = redis.call('HGET', totals, 'consumersExpired')
  if v and (not string.match(v, '^-?%d+$') or #v > 17) then
    redis.call('HSET', totals, 'consumersExpired', deleted)
  else
    redis.call('HINCRBY', totals, 'consumersExpired', deleted)
  end
end
return deleted
