-- Publish a group's settings for workers, and say which `minIdle` the passes may apply now.
--
-- KEYS[1] {T}:pelican:<stream>:<group>:settings
-- ARGV[1] minIdleMs    ARGV[2] retryAfterMs    ARGV[3] maxDeliveries    ARGV[4] contractVersion
-- ARGV[5] hold (ms): how long a lowered minIdle waits before the passes apply it
-- ARGV[6] partitions   ARGV[7] ordering   ARGV[8] backoffFactor   ARGV[9] backoffMaxMs (0: none): only for a topic's
--         own settings key (SPEC 22); absent for a stream's
--
-- Returns {min idle the passes apply now (ms), ms until that changes (0: it is the published one)}.
--
-- Workers extend their leases at a pace set by the `minIdleMs` they last read (contract/README.md: they re-read it at
-- every lease tick, at least every 10 s). A pass that applied a lowered value at once would take the entries of slow
-- handlers whose worker still leases at the old, slower pace, and run them twice. So a lowered value is published at
-- once, and the passes go on applying the old one (`heldMinIdleMs`) until `heldUntilMs`, by the server's clock, which
-- every operator replica shares. A raised value applies at once: workers then lease more often than needed.
-- Invariant: the hash holds the policy's values after every call; while a hold runs, the passes never apply less than
-- the highest minIdle published within the hold. Writes only when something changed (workers read the hash often).
local key = KEYS[1]
local t = redis.call('TYPE', key)['ok']
if t ~= 'none' and t ~= 'hash' then
  return redis.error_reply('WRONGTYPE key ' .. key .. ' holds a ' .. t .. ', not a hash')
end
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local wanted, hold = tonumber(ARGV[1]), tonumber(ARGV[5])
local stored = redis.call('HMGET', key, 'minIdleMs', 'retryAfterMs', 'maxDeliveries', 'contractVersion',
  'heldMinIdleMs', 'heldUntilMs')
local published, held, held_until = tonumber(stored[1]), tonumber(stored[5]), tonumber(stored[6])
if held == nil or held_until == nil or held_until <= now_ms then held, held_until = nil, nil end
if published and wanted < published then
  held = math.max(published, held or 0)
  held_until = now_ms + hold
  redis.call('HSET', key, 'heldMinIdleMs', string.format('%d', held), 'heldUntilMs', string.format('%d', held_until))
end
if stored[1] ~= ARGV[1] or stored[2] ~= ARGV[2] or stored[3] ~= ARGV[3] or stored[4] ~= ARGV[4] then
  redis.call('HSET', key, 'minIdleMs', ARGV[1], 'retryAfterMs', ARGV[2], 'maxDeliveries', ARGV[3],
    'contractVersion', ARGV[4])
end
if ARGV[7] then
  local topic = redis.call('HMGET', key, 'partitions', 'ordering', 'backoffFactor', 'backoffMaxMs')
  if topic[1] ~= ARGV[6] or topic[2] ~= ARGV[7] or topic[3] ~= ARGV[8] or topic[4] ~= ARGV[9] then
    redis.call('HSET', key, 'partitions', ARGV[6], 'ordering', ARGV[7], 'backoffFactor', ARGV[8], 'backoffMaxMs', ARGV[9])
  end
end
if held and held > wanted then return {held, held_until - now_ms} end
return {wanted, 0}
