-- Destroy a policy's consumer group, when the group is the policy's to destroy.
--
-- KEYS[1] the stream       KEYS[2] {T}:pelican:<stream>:<group>:creator (the uid of the policy that created the group)
-- KEYS[3] {T}:pelican:<stream>:<group>:settings (what workers read of the policy's retry settings)
-- ARGV[1] group            ARGV[2] the deleted policy's uid
-- ARGV[3] '1': the policy adopts the group (`spec.adoptGroup`), destroy it whoever created it
--
-- Returns {'destroyed'}, {'absent'} (no such stream or group: nothing to do), or {'retained', <creator>}: the group
-- was made by someone else (by hand, by another tool, by another policy: <creator> is that policy's uid, or '' when
-- no policy made it) and the policy does not adopt it.
--
-- Invariant: a group is destroyed only by the policy that created it, or one that says it adopts it; the check and
-- the XGROUP DESTROY are one call, so no other policy can create the group in between. The creator record and the
-- workers' settings go with the group.
local stream, creator_key, settings_key = KEYS[1], KEYS[2], KEYS[3]
local group, uid, adopt = ARGV[1], ARGV[2], ARGV[3] == '1'

if redis.call('TYPE', stream)['ok'] ~= 'stream' then return {'absent'} end
local creator = redis.call('GET', creator_key)
if not adopt and creator ~= uid then return {'retained', creator or ''} end
local destroyed = redis.call('XGROUP', 'DESTROY', stream, group)
if creator == uid or destroyed == 1 then redis.call('DEL', creator_key) end
if destroyed == 1 then
  redis.call('DEL', settings_key)
  return {'destroyed'}
end
return {'absent'}
