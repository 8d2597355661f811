-- Retention `Acknowledged`: trim what every group of the stream has acknowledged and is old enough.
--
-- KEYS[1] stream    KEYS[2] {T}:pelican:<stream>:<group>:totals (the counting policy's)
-- ARGV[1] minAge in milliseconds    ARGV[2] '1': the server has `XTRIM ... ACKED` (Redis 8.2+): add it
-- ARGV[3] most entries one call frees (at least 2 * NODE_MARGIN)
--
-- Reply: {trimmed, pinning group or '', 'pending' | 'unread' | '', the pinning entry id or '', more}: `more` is 1
-- when the call stopped at ARGV[3] and entries below the safe point may remain (call again).
-- The safe point is the smallest, over all groups of the stream (managed by a policy or not), of the group's oldest
-- pending id and the first id after its last-delivered-id; entries below it and older than minAge (by the time in
-- their id, against the server's clock) are trimmed with XTRIM MINID.
-- Cost: freeing entries costs the server as many as there are (an acknowledged backlog of a million held it 149 ms
-- on Redis 7.0, 297 ms on Valkey 9.1), so a call frees at most ARGV[3]: first whole nodes of the stream's radix
-- tree (`MINID ~ <id> LIMIT <n>`, which frees no node holding an entry at or above the id), then, only when that
-- stopped short of the limit by more than NODE_MARGIN (so it stopped at the node holding the safe point, not at the
-- limit), the exact `MINID <id>` of what is left below it: at most one node's entries (`stream-node-max-entries`,
-- 100 by default; a node of tiny entries within `stream-node-max-bytes` holds fewer than NODE_MARGIN).
-- Invariant: no entry any group still has pending or has not read is removed, and a stream without groups is never
-- trimmed. The script runs atomically, so no group can be created, and no entry read, between the look and the trim.
-- `trimmed` is added to the totals hash (a field holding no integer starts again). With ARGV[2], the exact trim of
-- the last node is `XTRIM MINID <id> ACKED` (never with `~`, and only ever on a stream with groups: on 8.6 ACKED on a
-- stream without groups trims everything): the server itself also keeps every entry some group has not acknowledged
-- there, a second net under the computed safe point, which stays the reason `pinnedBy` gives.
local function split(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return ms, seq
end

-- Compares ids as digit strings, so no precision is lost on large sequence numbers.
local function less(a, b)
  local am, as = split(a)
  local bm, bs = split(b)
  if #am ~= #bm then return #am < #bm end
  if am ~= bm then return am < bm end
  if #as ~= #bs then return #as < #bs end
  return as < bs
end

-- The first id after `id`; `id` itself (one entry kept that could go) when its sequence is too large to add to
-- exactly.
local function after(id)
  local ms, seq = split(id)
  if #seq > 15 then return id end
  return ms .. '-' .. string.format('%d', tonumber(seq) + 1)
end

if redis.call('EXISTS', KEYS[1]) == 0 then
  return {0, '', '', '', 0}
end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
if #groups == 0 then
  return {0, '', '', '', 0}
end
local safe, group, why = nil, '', ''
for _, info in ipairs(groups) do
  local g = {}
  for j = 1, #info, 2 do g[info[j]] = info[j + 1] end
  local candidates = {{after(g['last-delivered-id']), 'unread'}}
  if g['pending'] > 0 then
    local oldest = redis.call('XPENDING', KEYS[1], g['name'], '-', '+', 1)
    if oldest[1] then table.insert(candidates, {oldest[1][1], 'pending'}) end
  end
  for _, c in ipairs(candidates) do
    if safe == nil or less(c[1], safe) then
      safe, group, why = c[1], g['name'], c[2]
    end
  end
end
local time = redis.call('TIME')
local cutoff_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) - tonumber(ARGV[1])
local cutoff = string.format('%d', math.max(cutoff_ms, 0)) .. '-0'
local minid, pinned = safe, safe
if less(cutoff, safe) then
  minid, group, why, pinned = cutoff, '', '', ''
end
-- Read before the trim: a totals key of the wrong type fails the call before anything is removed.
local v = redis.call('HGET', KEYS[2], 'trimmed')
local NODE_MARGIN = 2000
local limit = ARGV[3]
-- Whole nodes first, without ACKED (whose `~` deleted nothing on 8.2.2 and 8.4.0): the safe point computed above
-- holds for them, in this same atomic call.
local trimmed = redis.call('XTRIM', KEYS[1], 'MINID', '~', minid, 'LIMIT', limit)
local more = 1
if trimmed <= tonumber(limit) - NODE_MARGIN then
  if ARGV[2] == '1' then
    trimmed = trimmed + redis.call('XTRIM', KEYS[1], 'MINID', minid, 'ACKED')
  else
    trimmed = trimmed + redis.call('XTRIM', KEYS[1], 'MINID', minid)
  end
  more = 0
end
if trimmed > 0 then
  if v and (not string.match(v, '^%d+$') or #v > 17) then
    redis.call('HSET', KEYS[2], 'trimmed', trimmed)
  else
    redis.call('HINCRBY', KEYS[2], 'trimmed', trimmed)
  end
end
return {trimmed, group, why, pinned, more}
