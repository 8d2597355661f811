-- Membership: the members of a topic's group, and which partitions each one owns (contract/README.md, "Topics").
--
-- KEYS[1] {T}:pelican:T:<group>:members (member -> its lease deadline, the server's ms)
-- KEYS[2] {T}:pelican:T:<group>:owners  (partition index -> member)
-- KEYS[3] {T}:pelican:T:<group>:epochs  (partition index -> epoch, incremented at every hand-over)
-- ARGV[1] the member's name; '' only sweeps expired members (the operator's call)
-- ARGV[2] the lease ttl, ms (1 .. 86,400,000; a sweep ignores it)
-- ARGV[3] the topic's partitions N (1 .. 1024)
-- ARGV[4] 1: the member leaves (it finished everything in flight) and releases all it owns; 0: a heartbeat
-- ARGV[5..] the partitions this member released since its last call (it finished their in-flight work)
--
-- With the server's TIME: drops members whose deadline passed and frees their partitions; renews the caller's
-- deadline (now + ttl); frees the partitions it says it released, when they are its own; then computes its target
-- (the live members sorted by name, bytewise, M of them: each gets floor(N / M), the first N mod M one more). Over
-- its target, it is told to release its highest-numbered partitions, and keeps them until it says it released
-- them; under it, it takes free partitions, lowest-numbered first, each with HINCRBY epochs p 1.
--
-- Returns {owned, release, members}: owned = {{partition, epoch}, ...} in partition order, release = the partitions
-- to finish and release, members = M after the call. A join beyond 1024 live members is the error
-- PELICAN_TOO_MANY_MEMBERS, with nothing written; so is any malformed argument (ERR ...).
-- Invariant: a partition has at most one owner, and changes owner only once it is free: released by its owner or
-- its owner expired. Partitions move only when balance needs it (sticky), and a member never takes more than its
-- target, so that every member reaches its target once the others released theirs.
-- Cost: one HGETALL of members (at most 1024) and of owners (at most N), one HSET or HDEL per change, one HGET of
-- epochs per owned partition: O(N + M) for a call (names compared bytewise), N <= 1024 and M <= 1024.
local members_key, owners_key, epochs_key = KEYS[1], KEYS[2], KEYS[3]
local MAX_MEMBERS, MAX_PARTITIONS, MAX_TTL = 1024, 1024, 86400000

local function integer(text, low, high)
  if type(text) ~= 'string' or not string.match(text, '^%d+$') then return nil end
  local n = tonumber(text)
  if n < low or n > high then return nil end
  return n
end

-- Byte order, whatever the server's locale (Lua's `<` on strings follows LC_COLLATE).
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local member = ARGV[1]
local ttl = integer(ARGV[2], 1, MAX_TTL)
if not ttl and member ~= '' then return redis.error_reply('ERR membership: the ttl must be 1 .. ' .. MAX_TTL .. ' ms, got ' .. tostring(ARGV[2])) end
local partitions = integer(ARGV[3], 1, MAX_PARTITIONS)
if not partitions then
  return redis.error_reply('ERR membership: partitions must be 1 .. ' .. MAX_PARTITIONS .. ', got ' .. tostring(ARGV[3]))
end
if ARGV[4] ~= '0' and ARGV[4] ~= '1' then
  return redis.error_reply('ERR membership: the leaving flag must be 0 or 1, got ' .. tostring(ARGV[4]))
end
local leaving = ARGV[4] == '1'
if #ARGV - 4 > partitions then
  return redis.error_reply('ERR membership: ' .. (#ARGV - 4) .. ' released partitions, more than the ' .. partitions)
end
local released = {}
for i = 5, #ARGV do
  local p = integer(ARGV[i], 0, partitions - 1)
  if not p then
    return redis.error_reply('ERR membership: released partition ' .. tostring(ARGV[i]) .. ' is not 0 .. ' .. (partitions - 1))
  end
  released[#released + 1] = p
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Who is live: every member whose deadline has not passed.
local live, live_count, expired = {}, 0, {}
local stored = redis.call('HGETALL', members_key)
for i = 1, #stored, 2 do
  local deadline = tonumber(stored[i + 1])
  if deadline and deadline > now then
    live[stored[i]] = true
    live_count = live_count + 1
  else
    expired[#expired + 1] = stored[i]
  end
end
local joining = member ~= '' and not leaving and not live[member]
if joining and live_count >= MAX_MEMBERS then
  return redis.error_reply('PELICAN_TOO_MANY_MEMBERS the group has ' .. live_count .. ' live members, the limit is ' ..
    MAX_MEMBERS .. ': ' .. member .. ' cannot join')
end

-- (a) Drop the expired members; free every partition whose owner is not live (expired, or left without a trace)
-- or whose index is outside the topic.
for _, name in ipairs(expired) do redis.call('HDEL', members_key, name) end
local owner = {}
local stored_owners = redis.call('HGETALL', owners_key)
for i = 1, #stored_owners, 2 do
  local p = integer(stored_owners[i], 0, partitions - 1)
  local name = stored_owners[i + 1]
  if p and live[name] and not (leaving and name == member) then
    owner[p] = name
  else
    redis.call('HDEL', owners_key, stored_owners[i])
  end
end

if member == '' then return {{}, {}, live_count} end
if leaving then
  if live[member] then
    redis.call('HDEL', members_key, member)
    live_count = live_count - 1
  end
  return {{}, {}, live_count}
end

-- (b) Renew the caller's deadline.
redis.call('HSET', members_key, member, string.format('%d', now + ttl))
if joining then
  live[member] = true
  live_count = live_count + 1
end

-- (c) Free what the caller released, when it is still its own.
for _, p in ipairs(released) do
  if owner[p] == member then
    owner[p] = nil
    redis.call('HDEL', owners_key, p)
  end
end

-- (d) The caller's target: its rank among the live members sorted by name.
local rank = 0
for name in pairs(live) do
  if before(name, member) then rank = rank + 1 end
end
local target = math.floor(partitions / live_count)
if rank < partitions % live_count then target = target + 1 end

-- (e) Release the highest-numbered over the target; take free ones, lowest-numbered first, up to it.
local owned, release = {}, {}
for p = 0, partitions - 1 do
  if owner[p] == member then owned[#owned + 1] = p end
end
for i = target + 1, #owned do release[#release + 1] = owned[i] end
local p = 0
while #owned < target and p < partitions do
  if owner[p] == nil then
    owner[p] = member
    redis.call('HSET', owners_key, p, member)
    redis.call('HINCRBY', epochs_key, p, 1)
    owned[#owned + 1] = p
  end
  p = p + 1
end
table.sort(owned)
local reply = {}
for i, q in ipairs(owned) do
  reply[i] = {q, tonumber(redis.call('HGET', epochs_key, q)) or 0}
end
return {reply, release, live_count}
