-- Destroy a policy's consumer group, when the group is the policy's to destroy, a bounded step per call.
--
-- KEYS[1] the stream       KEYS[2] {T}:pelican:<stream>:<group>:creator (the uid of the policy that created the group)
-- KEYS[3] {T}:pelican:<stream>:<group>:settings (what workers read of the policy's retry settings)
-- ARGV[1] group            ARGV[2] the deleted policy's uid
-- ARGV[3] '1': the policy adopts the group (`spec.adoptGroup`), destroy it whoever created it
-- ARGV[4] most pending entries one call acknowledges, and most consumers one call deletes
--
-- Returns {'destroyed'}, {'absent'} (no such stream or group: nothing to do), {'retained', <creator>}: the group
-- was made by someone else (by hand, by another tool, by another policy: <creator> is that policy's uid, or '' when
-- no policy made it) and the policy does not adopt it; or {'step'}: this call took its share of the group apart,
-- call again.
--
-- Cost: `XGROUP DESTROY` frees the group's PEL and consumers in one command (a 300,000-entry PEL and as many
-- consumers held Redis 7.0 119 ms, Valkey 9.1 389 ms). So a group is taken apart first, ARGV[4] at a time: its
-- pending entries acknowledged oldest first, and each consumer that owned one of them deleted once it owns nothing
-- (`XGROUP DELCONSUMER` of a consumer without entries costs one consumer). What DESTROY then frees is the
-- consumers that never owned an entry the steps saw: Redis cannot name them without listing them all.
--
-- Invariant: a group is destroyed, or its entries acknowledged, only for the policy that created it, or one that
-- says it adopts it; each call checks it again before its first write, so no other policy's group is touched. The
-- creator record and the workers' settings go with the group, in the call that destroys it.
local stream, creator_key, settings_key = KEYS[1], KEYS[2], KEYS[3]
local group, uid, adopt, batch = ARGV[1], ARGV[2], ARGV[3] == '1', tonumber(ARGV[4])

if redis.call('TYPE', stream)['ok'] ~= 'stream' then return {'absent'} end
local creator = redis.call('GET', creator_key)
if not adopt and creator ~= uid then return {'retained', creator or ''} end
local found = false
for _, g in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
  for i = 1, #g, 2 do
    if g[i] == 'name' and g[i + 1] == group then found = true end
  end
end
if found then
  local page = redis.call('XPENDING', stream, group, '-', '+', batch)
  if #page > 0 then
    local ids, owners = {}, {}
    for i, p in ipairs(page) do
      ids[i] = p[1]
      owners[p[2]] = true
    end
    redis.call('XACK', stream, group, unpack(ids))
    local deleted = 0
    for owner in pairs(owners) do
      if deleted < batch and #redis.call('XPENDING', stream, group, '-', '+', 1, owner) == 0 then
        redis.call('XGROUP', 'DELCONSUMER', stream, group, owner)
        deleted = deleted + 1
      end
    end
    return {'step'}
  end
end
local destroyed = found and redis.call('XGROUP', 'DESTROY', stream, group) or 0
if creator == uid or destroyed == 1 then redis.call('DEL', creator_key) end
if destroyed == 1 then
  redis.call('DEL', settings_key)
  return {'destroyed'}
end
return {'absent'}
