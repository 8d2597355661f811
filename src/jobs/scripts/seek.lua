-- Seek: move a group to a new position, once, with the entries pending at that moment handled as asked.
--
-- KEYS[1] source stream    KEYS[2] dead-letter stream    KEYS[3] totals hash
-- KEYS[4] seeks hash: seek uid -> the result of the seek that ran (JSON)
-- KEYS[5] redrive lock of the dead-letter stream: a redrive moving entries back into the stream
-- ARGV[1] group            ARGV[2] the seek's uid
-- ARGV[3] target: time | id | earliest | latest | shift     ARGV[4] its value: milliseconds (time), an id (id), a
--         signed count of entries (shift; negative moves back), '' otherwise
-- ARGV[5] pending: Keep | Acknowledge | DeadLetter         ARGV[6] refuse while a consumer was active this recently
--         (ms; 0: no check)
-- ARGV[7] the operator's consumer name (never counted as active)    ARGV[8] '1': plan only, change nothing
-- ARGV[9] dead-letter MAXLEN (0: no cap)
--
-- Returns {'done', <JSON>} with from {id, entriesRead, lag}, to {id, entriesRead, lag}, redelivered, skipped,
-- pendingHandled, oldestAvailable, dryRun; {'refused', reason, message}; or, when this uid ran before, the result
-- it recorded then ({'done', <JSON>} again, nothing moved twice).
--
-- The position is the group's last-delivered-id: the group reads next the first entry after it. A target id T (or
-- time T, as `T-0`) becomes the position just before T, so the first entry at or after T is read next, whether T
-- itself is in the stream or not. ENTRIES-READ is set to entries-added minus the entries after the new position,
-- counted here, so the lag the server reports afterwards is exact.
--
-- Invariant: all or nothing, and once. Every refusal is decided before the first write; the move, the handling of
-- the entries pending at that moment, the counters and the record of the seek are one atomic call, and a seek
-- whose uid is recorded returns its recorded result without writing: an operator killed after the call and before
-- its status write finds the seek done, never runs it twice. Cost: the entries after the old and new positions are
-- counted a thousand at a time (a replay of 100,000 entries walks them once), and the PEL is walked once when its
-- entries are acknowledged or dead-lettered.

local src, dlq, totals, seeks, redrive_lock = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group, uid, target, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local pending_mode, idle_floor, operator = ARGV[5], tonumber(ARGV[6]), ARGV[7]
local dry_run, dlq_maxlen = ARGV[8] == '1', tonumber(ARGV[9])

local MAX_SEQ = '18446744073709551615'

local recorded = redis.call('HGET', seeks, uid)
if recorded then return {'done', recorded} end

local function refused(reason, message) return {'refused', reason, message} end

-- {ms, seq} of an id (`<ms>-<seq>` or `<ms>`), as numbers (exact up to 2^53: every real id).
local function parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if ms then return tonumber(ms), tonumber(seq) end
  return tonumber(id), 0
end

local function before(a, b)
  local am, as = parts(a)
  local bm, bs = parts(b)
  return am < bm or (am == bm and as < bs)
end

-- The position just before `id`: reading after it starts at `id`.
local function predecessor(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms then ms, seq = id, '0' end
  if seq ~= '0' then return ms .. '-' .. string.format('%.0f', tonumber(seq) - 1) end
  if ms == '0' then return '0-0' end
  return string.format('%.0f', tonumber(ms) - 1) .. '-' .. MAX_SEQ
end

-- A flat RESP2 map (XINFO replies inside scripts) as a table.
local function map(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
end

-- Entries after `position` (exclusive), counted a thousand at a time; `limit` stops early: then the id of the
-- `limit`-th entry is returned too.
local function walk_after(position, limit)
  local count, from, last = 0, '(' .. position, nil
  while true do
    local want = 1000
    if limit and limit - count < want then want = limit - count end
    if want <= 0 then return count, last end
    local page = redis.call('XRANGE', src, from, '+', 'COUNT', want)
    count = count + #page
    if #page > 0 then last = page[#page][1] end
    if #page < want then return count, last end
    from = '(' .. last
  end
end

-- The `n`-th entry before `position` (exclusive), walking back a thousand at a time; nil when there are fewer.
local function walk_back(position, n)
  local count, to = 0, '(' .. position
  while true do
    local want = math.min(1000, n - count)
    local page = redis.call('XREVRANGE', src, to, '-', 'COUNT', want)
    count = count + #page
    if count == n and #page > 0 then return page[#page][1] end
    if #page < want then return nil end
    to = '(' .. page[#page][1]
  end
end

if redis.call('TYPE', src)['ok'] ~= 'stream' then
  return refused('GroupNotFound', 'stream ' .. src .. ' does not exist')
end
local info
for _, g in ipairs(redis.call('XINFO', 'GROUPS', src)) do
  local fields = map(g)
  if fields['name'] == group then info = fields end
end
if not info then return refused('GroupNotFound', 'stream ' .. src .. ' has no group ' .. group) end
if redis.call('EXISTS', redrive_lock) == 1 then
  return refused('SeekInProgress', 'a DeadLetterRedrive moves entries of ' .. dlq .. ' back into the stream now (' ..
    tostring(redis.call('HGET', redrive_lock, 'name')) .. '): seek once it has finished')
end
if idle_floor > 0 then
  local active = {}
  for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', src, group)) do
    local fields = map(c)
    if fields['name'] ~= operator and tonumber(fields['idle']) < idle_floor then
      active[#active + 1] = fields['name'] .. ' (' .. math.floor(tonumber(fields['idle']) / 1000) .. 's ago)'
    end
  end
  if #active > 0 then
    return refused('ConsumersActive', 'consumers of group ' .. group .. ' were active within consumersIdleFor: ' ..
      table.concat(active, ', ') .. '; stop them first (or set consumersIdleFor: 0s to move under them)')
  end
end

local stream = map(redis.call('XINFO', 'STREAM', src))
local first = stream['first-entry'] and stream['first-entry'][1] or nil
local last_generated = stream['last-generated-id']
local added = tonumber(stream['entries-added'])
local now_parts = redis.call('TIME')
local now_ms = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)
local from_id = info['last-delivered-id']

-- The refusal of a start older than the stream's first entry when entries were removed (trimmed or deleted: fewer
-- than were ever added): what the group would replay from there is gone in part. A stream that never lost an entry
-- holds everything since any start.
local function beyond(start)
  if first and not before(start, first) then return nil end
  if added <= tonumber(stream['length']) then return nil end
  return refused('BeyondRetention', 'the target ' .. start .. ' is older than the stream\'s first entry ' ..
    tostring(first or 'none (the stream is empty)') .. ': entries since the target were trimmed or deleted; ' ..
    'status.oldestAvailable is as far back as a replay can go (to.position: Earliest)')
end

local position
if target == 'earliest' then
  position = '0-0'
elseif target == 'latest' then
  position = last_generated
elseif target == 'time' or target == 'id' then
  local start = target == 'time' and (value .. '-0') or value
  if not string.find(start, '-') then start = start .. '-0' end
  local start_ms = parts(start)
  if start_ms > now_ms then
    return refused('TargetInFuture', 'the target ' .. start .. ' lies ' .. math.floor((start_ms - now_ms) / 1000) ..
      ' s ahead of the server\'s clock: the group would skip every entry added until then')
  end
  local refusal = beyond(start)
  if refusal then return refusal end
  position = predecessor(start)
elseif target == 'shift' then
  local n = tonumber(value)
  if n < 0 then
    -- The n-th entry before the position becomes the position: the n entries after it are read again.
    position = walk_back(from_id, -n)
    if not position then
      return refused('BeyondRetention', 'the stream holds fewer than ' .. (-n) .. ' entries before the group\'s ' ..
        'position ' .. from_id .. ': status.oldestAvailable is as far back as a replay can go (to.position: Earliest)')
    end
  else
    local count, last = walk_after(from_id, n)
    position = (count < n or not last) and last_generated or last
  end
else
  return refused('InvalidSpec', 'unknown target ' .. target)
end

local from_after = walk_after(from_id)
local to_after = walk_after(position)
local result = {
  from = {id = from_id, entriesRead = info['entries-read'], lag = info['lag']},
  to = {id = position, entriesRead = added - to_after, lag = to_after},
  redelivered = math.max(0, to_after - from_after),
  skipped = math.max(0, from_after - to_after),
  pendingHandled = 0,
  oldestAvailable = first,
  dryRun = dry_run,
}

if pending_mode ~= 'Keep' then
  if dry_run then
    result.pendingHandled = tonumber(info['pending'])
  else
    local handled, dead_lettered, gone = 0, 0, 0
    while true do
      local page = redis.call('XPENDING', src, group, '-', '+', 1000)
      if #page == 0 then break end
      local acks = {}
      for _, p in ipairs(page) do
        local id, owner, deliveries = p[1], p[2], p[4]
        if pending_mode == 'DeadLetter' then
          local entry = redis.call('XRANGE', src, id, id)[1]
          if entry then
            local args = {dlq}
            if dlq_maxlen > 0 then args[2] = 'MAXLEN'; args[3] = '~'; args[4] = ARGV[9] end
            args[#args + 1] = '*'
            for _, f in ipairs(entry[2]) do args[#args + 1] = f end
            local a = #args
            args[a + 1] = 'pelican-source-stream'; args[a + 2] = src
            args[a + 3] = 'pelican-source-id'; args[a + 4] = id
            args[a + 5] = 'pelican-origin-id'; args[a + 6] = id
            args[a + 7] = 'pelican-group'; args[a + 8] = group
            args[a + 9] = 'pelican-consumer'; args[a + 10] = owner
            args[a + 11] = 'pelican-deliveries'; args[a + 12] = string.format('%d', deliveries)
            args[a + 13] = 'pelican-reason'; args[a + 14] = 'Seek'
            args[a + 15] = 'pelican-dead-lettered-at'; args[a + 16] = string.format('%d', now_ms)
            redis.call('XADD', unpack(args))
            dead_lettered = dead_lettered + 1
          else
            gone = gone + 1
          end
        end
        acks[#acks + 1] = id
      end
      redis.call('XACK', src, group, unpack(acks))
      handled = handled + #acks
    end
    if dead_lettered > 0 then redis.call('HINCRBY', totals, 'deadLettered', dead_lettered) end
    if gone > 0 then redis.call('HINCRBY', totals, 'payloadDeleted', gone) end
    result.pendingHandled = handled
  end
end

local encoded = cjson.encode(result)
if not dry_run then
  redis.call('XGROUP', 'SETID', src, group, position, 'ENTRIESREAD', string.format('%d', added - to_after))
  redis.call('HSET', seeks, uid, encoded)
end
return {'done', encoded}
