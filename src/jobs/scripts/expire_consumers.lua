-- Delete consumers idle at least ARGV[2] ms that own no pending entry.
--
-- KEYS[1] source stream    KEYS[2] totals hash
-- ARGV[1] group            ARGV[2] expire after (ms)
--
-- Returns the number of consumers deleted.
--
-- Invariant: no pending entry is ever destroyed. XGROUP DELCONSUMER silently drops the consumer's pending
-- entries, so the "owns nothing" check and the delete happen in this one script, where no client can interleave.
--
-- "Inactive" means the consumer has not even tried to read: XINFO CONSUMERS `idle`, the time since its last
-- attempted interaction (a blocking XREADGROUP counts when it is issued). Not `inactive` (Redis 7.2+ / Valkey),
-- the time since its last *successful* read: a healthy worker blocking on a quiet stream reads nothing for hours,
-- and deleting it every `expireAfter` would churn its name and its metrics. A worker that blocks without a
-- timeout (BLOCK 0) looks idle while it waits, so expireAfter must exceed the longest block.

local src, totals = KEYS[1], KEYS[2]
local group = ARGV[1]
local expire_after = tonumber(ARGV[2])

local t = redis.call('TYPE', src)['ok']
if t ~= 'stream' then return 0 end
local tt = redis.call('TYPE', totals)['ok']
if tt ~= 'none' and tt ~= 'hash' then
  return redis.error_reply('WRONGTYPE key ' .. totals .. ' holds a ' .. tt .. ', not a hash')
end

local deleted = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', src, group)) do
  local info = {}
  for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
  if tonumber(info['pending']) == 0 and tonumber(info['idle']) >= expire_after then
    redis.call('XGROUP', 'DELCONSUMER', src, group, info['name'])
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
