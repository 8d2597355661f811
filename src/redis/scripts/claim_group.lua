-- Which install runs a group's jobs: one per group, decided on the server itself, so that two installs of Pelican on
-- one Redis (two clusters, a DR pair, blue/green) never both run passes and write settings, whatever cluster each
-- runs in. A claim is a lease: renewed at every reconcile of its owner, it lapses when the owner stops renewing.
--
-- KEYS[1] {T}:pelican:<stream>:<group>:owner (string: the owning install's id, with a TTL)
-- ARGV[1] this install's id    ARGV[2] the claim's lifetime (ms)    ARGV[3] 'claim', or 'look' (a passive install)
--
-- Returns {1, ms left} when this install holds the claim (taken or renewed now), {0, owner, ms left} when another
-- install holds it, {0, '', 0} when nobody does and the caller only looked.
--
-- Invariant: at most one install holds a group at a time; a held claim passes to another install only after its
-- owner stopped renewing it for its whole lifetime; looking never writes.
local key, me, lifetime, op = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local owner = redis.call('GET', key)
if owner and owner ~= me then
  return {0, owner, redis.call('PTTL', key)}
end
if op == 'claim' then
  redis.call('SET', key, me, 'PX', lifetime)
  return {1, tonumber(lifetime)}
end
return {0, '', 0}
