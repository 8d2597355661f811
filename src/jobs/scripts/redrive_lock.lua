-- Which redrive owns a dead-letter stream now: one redrive per dead-letter stream, decided on the server, so the
-- order holds across operator restarts and between replicas.
--
-- KEYS[1] {T}:pelican:<dead-letter stream>:redrive-lock (hash: uid, name)
-- ARGV[1] 'claim' or 'release'   ARGV[2] the redrive's uid   ARGV[3] its namespace/name
-- ARGV[4] claim only: the uid of an owner the caller knows to be gone (deleted, finished or suspended), or ''
--
-- Returns {owner uid, owner name} after the call ({'', ''} when nobody owns the stream).
--
-- Invariant: a claim succeeds only when nobody owns the stream, the caller already does, or the owner is the one
-- the caller named as gone; a release removes the lock only when the caller owns it.
local lock, op, uid, name, gone = KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local owner = redis.call('HGET', lock, 'uid')
if op == 'release' then
  if owner == uid then redis.call('DEL', lock) end
elseif not owner or owner == uid or owner == gone then
  redis.call('HSET', lock, 'uid', uid, 'name', name)
end
local now = redis.call('HMGET', lock, 'uid', 'name')
return {now[1] or '', now[2] or ''}
