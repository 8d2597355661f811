-- Delete consumers inactive at least ARGV[2] ms that own no pending entry (SPEC section 3, "Consumer expiry").
--
-- KEYS[1] source stream    KEYS[2] totals hash
-- ARGV[1] group            ARGV[2] expire after (ms)
--
-- Returns the number of consumers deleted.
--
-- Invariant: no pending entry is ever destroyed. XGROUP DELCONSUMER silently drops the consumer's pending
-- entries, so the "owns nothing" check and the delete happen in this one script, where no client can interleave.
-- Inactivity is `inactive` (time since the last successful read, Redis 7.2+ / Valkey) when the server reports it
-- and it is set, else `idle` (Redis 7.0).

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
  local inactive = tonumber(info['inactive'])
  if inactive == nil or inactive < 0 then inactive = tonumber(info['idle']) end
  if tonumber(info['pending']) == 0 and inactive >= expire_after then
    redis.call('XGROUP', 'DELCONSUMER', src, group, info['name'])
    deleted = deleted + 1
  end
end
if deleted > 0 then redis.call('HINCRBY', totals, 'consumersExpired', deleted) end
return deleted
