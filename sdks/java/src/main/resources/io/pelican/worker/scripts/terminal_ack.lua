-- End a message as terminal: acknowledge it and count its reason, once.
--
-- KEYS[1] source stream    KEYS[2] {T}:pelican:<stream>:<group>:terminal
-- KEYS[3] (optional) {T}:pelican:<stream>:<group>:errors: the entry's last error, removed with the ACK
-- ARGV[1] group            ARGV[2] entry id    ARGV[3] reason code
--
-- Returns 1 when this call acknowledged the entry (and counted it), 0 when it was no longer pending.
-- Invariant: the counter moves only with the XACK that removed the entry, so a repeated ACK never counts twice.
-- Everything that can fail is checked before the XACK: an error reply means nothing was written and the entry is
-- still pending. A count field that holds no integer (any client can write one) starts again at 1.
local t = redis.call('TYPE', KEYS[2])['ok']
if t ~= 'none' and t ~= 'hash' then
  return redis.error_reply('WRONGTYPE key ' .. KEYS[2] .. ' holds a ' .. t .. ', not a hash')
end
if KEYS[3] then
  local e = redis.call('TYPE', KEYS[3])['ok']
  if e ~= 'none' and e ~= 'hash' then
    return redis.error_reply('WRONGTYPE key ' .. KEYS[3] .. ' holds a ' .. e .. ', not a hash')
  end
end
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  if KEYS[3] then redis.call('HDEL', KEYS[3], ARGV[2]) end
  local v = redis.call('HGET', KEYS[2], ARGV[3])
  if v and (not string.match(v, '^-?%d+$') or #v > 17) then
    redis.call('HSET', KEYS[2], ARGV[3], 1)
  else
    redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  end
  return 1
end
return 0
