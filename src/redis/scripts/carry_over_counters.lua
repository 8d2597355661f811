-- Carry the counts of the 0.1 counter keys over to the keys that name the stream.
--
-- KEYS[1] legacy totals   {T}:pelican:<group>:totals      KEYS[2] totals   {T}:pelican:<stream>:<group>:totals
-- KEYS[3] legacy terminal {T}:pelican:<group>:terminal    KEYS[4] terminal {T}:pelican:<stream>:<group>:terminal
-- ARGV: none
--
-- Returns the number of fields carried over.
--
-- Invariant: every count is carried exactly once. Each legacy hash is added into its new hash field by field and
-- deleted in the same script, so no client can see or count it twice. The caller runs this only when no other
-- policy could own the legacy keys. Types are checked before the first write, and counting cannot fail: a legacy
-- value that is not an integer is no count and is left out; a new field that holds no integer starts again.

for i = 1, 4 do
  local t = redis.call('TYPE', KEYS[i])['ok']
  if t ~= 'none' and t ~= 'hash' then
    return redis.error_reply('WRONGTYPE key ' .. KEYS[i] .. ' holds a ' .. t .. ', not a hash')
  end
end

local function count(key, field, n)
  local v = redis.call('HGET', key, field)
  if v and (not string.match(v, '^-?%d+$') or #v > 17) then
    redis.call('HSET', key, field, string.format('%d', n))
  else
    redis.call('HINCRBY', key, field, string.format('%d', n))
  end
end

local carried = 0
for i = 1, 3, 2 do
  local legacy, current = KEYS[i], KEYS[i + 1]
  local flat = redis.call('HGETALL', legacy)
  for f = 1, #flat, 2 do
    local v = flat[f + 1]
    if string.match(v, '^-?%d+$') and #v <= 17 then
      count(current, flat[f], tonumber(v))
      carried = carried + 1
    end
  end
  redis.call('DEL', legacy)
end
return carried
