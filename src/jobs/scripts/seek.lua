-- Seek: move a group to a new position, once, one bounded step per call.
--
-- KEYS[1] source stream    KEYS[2] dead-letter stream    KEYS[3] totals hash
-- KEYS[4] seeks hash: <namespace>/<name> of a GroupSeek -> its record (JSON): its uid and, while it runs, how far
--         it got; once it moved the group, its result
-- KEYS[5] redrive lock of the dead-letter stream: a redrive moving entries back into the stream
-- KEYS[6] errors hash: entry id -> the text of its last failure (carried into a dead letter as the reclaim does)
-- ARGV[1] group            ARGV[2] the seek's uid        ARGV[3] its namespace/name
-- ARGV[4] target: time | id | earliest | latest | shift     ARGV[5] its value: milliseconds (time), an id (id), a
--         signed count of entries (shift; negative moves back), '' otherwise
-- ARGV[6] pending: Keep | Acknowledge | DeadLetter         ARGV[7] refuse while a consumer was active this recently
--         (ms; 0: no check)
-- ARGV[8] the operator's consumer name (never counted as active)    ARGV[9] '1': plan only, change nothing
-- ARGV[10] dead-letter MAXLEN (0: no cap)                  ARGV[11] most bytes of an error text kept
-- ARGV[12] most consumers the group may have for the check of ARGV[7] to list them (XINFO CONSUMERS)
--
-- Returns {'step'}: this call did its share, call again; {'done', <JSON>} with from {id, entriesRead, lag}, to {id,
-- entriesRead, lag}, redelivered, skipped, pendingHandled, oldestAvailable, dryRun; {'refused', reason, message};
-- {'finished', <JSON>, uid}: a GroupSeek of this name (another object, uid) moved the group before, its result;
-- {'unreadable', <record>}: the record is not one this version writes.
--
-- The position is the group's last-delivered-id: the group reads next the first entry after it. A target id T (or
-- time T, as `T-0`) becomes the position just before T, so the first entry at or after T is read next, whether T
-- itself is in the stream or not. Ids are compared and decremented as digit strings: a sequence above 2^53 (the
-- `<ms>-18446744073709551615` a time seek reports) is exact. ENTRIES-READ is set to entries-added minus the
-- entries after the new position, so the lag the server reports afterwards is exact.
--
-- Cost: a call reads at most READ_ENTRIES entries or READ_BYTES bytes of them (whichever comes first; each field
-- counts FIELD_COST bytes beyond its length), and handles
-- at most PENDING_BATCH pending entries: a few milliseconds whatever the stream's length, the PEL's size or the
-- shift. The check of active consumers lists them (XINFO CONSUMERS, each made a Lua table) only while the group has
-- at most ARGV[12]; past that the seek is refused with TooManyConsumers, and made once per call. The work that needs more (counting the entries after a position, walking a shift, handling the PEL) goes
-- on in the next call from a cursor recorded in the seek's record, so a caller that stops (a timeout, an operator
-- restart, another replica taking over) resumes where the last call ended and never walks the stream again.
-- The entries after a position are counted by walking from it to the stream's end, except where the server knows
-- the number: 0 after the last id, the stream's length before its first entry, and the group's own `lag` when the
-- server reports it. A count is thrown away and walked again when entries it counted may have been deleted or
-- trimmed since (the stream's max-deleted-entry-id or its first entry moved past the walk's start), at most
-- RESTARTS times.
--
-- Invariant: once, and the move atomic. The refusals are decided in the first call and again in the last, before
-- the first write. The pending entries (Acknowledge, DeadLetter) are handled a batch per call before the move,
-- oldest first, each dead letter written before the XACK that retires its original, the cursor recorded in the
-- same call: once a batch was handled the seek goes on to the move (nothing is refused any more). The move (XGROUP
-- SETID with ENTRIESREAD), the last batch and the record of the result are one call; a record holding a result is
-- returned without writing, to this object or, with 'finished', to another object of the same name (a manifest
-- applied again after a delete): a seek never moves a group twice. A dry run writes only its cursor and removes it
-- when it answers.

local src, dlq, totals, seeks, redrive_lock, errors = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local group, uid, name, target, value = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local pending_mode, idle_floor, operator = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local dry_run, dlq_maxlen, error_max = ARGV[9] == '1', tonumber(ARGV[10]), tonumber(ARGV[11])
local max_consumers = tonumber(ARGV[12])

local READ_ENTRIES, READ_BYTES, PENDING_BATCH, RESTARTS = 4096, 2 * 1024 * 1024, 512, 5
-- What a field costs beyond its bytes, charged to READ_BYTES: a field costs the server about what 512 bytes of its
-- value do, so an entry of thousands of empty fields is no longer free.
local FIELD_COST = 512
local MAX_SEQ = '18446744073709551615'

local raw = redis.call('HGET', seeks, name)
local state
if raw then
  local ok, decoded = pcall(cjson.decode, raw)
  if not ok or type(decoded) ~= 'table' or type(decoded.uid) ~= 'string' then return {'unreadable', raw} end
  if decoded.result then
    if decoded.uid == uid then return {'done', cjson.encode(decoded.result)} end
    return {'finished', cjson.encode(decoded.result), decoded.uid}
  end
  -- A run of another object of this name that never moved the group (deleted half way): this one starts anew.
  if decoded.uid == uid then state = decoded end
end

local function refused(reason, message)
  redis.call('HDEL', seeks, name)
  return {'refused', reason, message}
end

-- Ids as digit strings: `<ms>-<seq>` (or `<ms>`), leading zeros dropped.
local function parts(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  if not ms then ms, seq = id, '0' end
  return (string.gsub(ms, '^0+(%d)', '%1')), (string.gsub(seq, '^0+(%d)', '%1'))
end
local function cmp_digits(a, b)
  if #a ~= #b then return #a < #b and -1 or 1 end
  if a == b then return 0 end
  return a < b and -1 or 1
end
-- -1, 0, 1 as id a comes before, is, or comes after id b.
local function cmp(a, b)
  local am, as = parts(a)
  local bm, bs = parts(b)
  local c = cmp_digits(am, bm)
  if c ~= 0 then return c end
  return cmp_digits(as, bs)
end
-- `digits` minus one (digits > 0).
local function decrement(digits)
  local bytes = {string.byte(digits, 1, -1)}
  local i = #bytes
  while bytes[i] == 48 do bytes[i] = 57; i = i - 1 end
  bytes[i] = bytes[i] - 1
  return (string.gsub(string.char(unpack(bytes)), '^0+(%d)', '%1'))
end
-- The position just before `id`: reading after it starts at `id`.
local function predecessor(id)
  local ms, seq = parts(id)
  if seq ~= '0' then return ms .. '-' .. decrement(seq) end
  if ms == '0' then return '0-0' end
  return decrement(ms) .. '-' .. MAX_SEQ
end

-- A flat RESP2 map (XINFO replies inside scripts) as a table.
local function map(flat)
  local t = {}
  for i = 1, #flat, 2 do t[flat[i]] = flat[i + 1] end
  return t
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
local stream = map(redis.call('XINFO', 'STREAM', src))
local first = stream['first-entry'] and stream['first-entry'][1] or nil
local last_generated = stream['last-generated-id']
local deleted = stream['max-deleted-entry-id'] or '0-0'
local added = tonumber(stream['entries-added'])
local now_parts = redis.call('TIME')
local now_ms = tonumber(now_parts[1]) * 1000 + math.floor(tonumber(now_parts[2]) / 1000)

-- What this call may still read.
local read_entries, read_bytes = 0, 0
local function spent() return read_entries >= READ_ENTRIES or read_bytes >= READ_BYTES end
-- How many entries the next read may ask for: one page at most, fewer as the budget runs out, and one until the
-- entries' size is known (a first page of 64 entries of a megabyte would be 64 MB).
local function page_size(want)
  local n = math.min(want or 1000, 1000, READ_ENTRIES - read_entries)
  if read_entries == 0 then return 1 end
  local average = math.max(1, read_bytes / read_entries)
  return math.max(1, math.min(n, math.floor((READ_BYTES - read_bytes) / average)))
end
local function read(command, a, b, count)
  local page = redis.call(command, src, a, b, 'COUNT', count)
  for _, entry in ipairs(page) do
    read_entries = read_entries + 1
    for _, f in ipairs(entry[2]) do read_bytes = read_bytes + #f + FIELD_COST end
  end
  return page
end

-- A walk counts the entries after `after` ({after, cursor, n}): true once it reached the stream's end.
local function advance(walk)
  while not spent() do
    local want = page_size()
    local page = read('XRANGE', '(' .. walk.cursor, '+', want)
    walk.n = walk.n + #page
    if #page > 0 then walk.cursor = page[#page][1] end
    if #page < want then return true end
  end
  return false
end
local function new_walk(after) return {after = after, cursor = after, n = 0} end

-- The refusals, decided before the first write (and again before the move, unless pending entries were handled),
-- once per call: the call is atomic.
local checked = false
local function refusal(start)
  if checked then return end
  checked = true
  if redis.call('EXISTS', redrive_lock) == 1 then
    return 'SeekInProgress', 'a DeadLetterRedrive moves entries of ' .. dlq .. ' back into the stream now (' ..
      tostring(redis.call('HGET', redrive_lock, 'name')) .. '): seek once it has finished'
  end
  if idle_floor > 0 and tonumber(info['consumers']) > max_consumers then
    return 'TooManyConsumers', 'group ' .. group .. ' has ' .. info['consumers'] .. ' consumers, more than the ' ..
      ARGV[12] .. ' a seek lists to see which were active (XINFO CONSUMERS holds the server for as long as there ' ..
      'are): delete the consumers nobody uses (XGROUP DELCONSUMER), or set consumersIdleFor: 0s to move under them'
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
      return 'ConsumersActive', 'consumers of group ' .. group .. ' were active within consumersIdleFor: ' ..
        table.concat(active, ', ') .. '; stop them first (or set consumersIdleFor: 0s to move under them)'
    end
  end
  -- A start older than the stream's first entry when entries were removed (trimmed or deleted: fewer than were
  -- ever added): what the group would replay from there is gone in part.
  if start then
    if not ((first and cmp(start, first) >= 0) or added <= tonumber(stream['length'])) then
      return 'BeyondRetention', 'the target ' .. start .. ' is older than the stream\'s first entry ' ..
        tostring(first or 'none (the stream is empty)') .. ': entries since the target were trimmed or deleted; ' ..
        'status.oldestAvailable is as far back as a replay can go (to.position: Earliest)'
    end
  end
end

local function save()
  redis.call('HSET', seeks, name, cjson.encode(state))
  return {'step'}
end

-- The first call: the target, and the refusals.
if not state then
  state = {uid = uid, from = info['last-delivered-id'], restarts = 0, pending = '-', handled = 0, deleted = deleted,
    first = first or ''}
  if target == 'earliest' then
    state.position = '0-0'
  elseif target == 'time' or target == 'id' then
    local start = target == 'time' and (value .. '-0') or value
    local start_ms = parts(start)
    if cmp_digits(start_ms, string.format('%d', now_ms)) > 0 then
      return refused('TargetInFuture', 'the target ' .. start .. ' lies ' ..
        math.floor((tonumber(start_ms) - now_ms) / 1000) .. ' s ahead of the server\'s clock: the group would ' ..
        'skip every entry added until then')
    end
    state.start, state.position = start, predecessor(start)
  elseif target == 'shift' then
    state.shift = {cursor = state.from, n = 0, want = math.abs(tonumber(value)), back = tonumber(value) < 0}
  elseif target ~= 'latest' then
    return refused('InvalidSpec', 'unknown target ' .. target)
  end
  local reason, message = refusal(state.start)
  if reason then return refused(reason, message) end
end

-- A shift: the n-th entry before the group's position, or after it, walked a budget at a time.
if state.shift then
  local shift = state.shift
  while shift.n < shift.want and not spent() do
    local want = page_size(shift.want - shift.n)
    local page
    if shift.back and shift.cursor == '0-0' then
      page = {}
    elseif shift.back then
      page = read('XREVRANGE', '(' .. shift.cursor, '-', want)
    else
      page = read('XRANGE', '(' .. shift.cursor, '+', want)
    end
    shift.n = shift.n + #page
    if #page > 0 then shift.cursor = page[#page][1] end
    if #page < want then break end
  end
  if shift.n < shift.want and spent() then return save() end
  if shift.back and shift.n < shift.want then
    return refused('BeyondRetention', 'the stream holds fewer than ' .. shift.want .. ' entries before the ' ..
      'group\'s position ' .. state.from .. ': status.oldestAvailable is as far back as a replay can go ' ..
      '(to.position: Earliest)')
  end
  state.position = (shift.n < shift.want) and last_generated or shift.cursor
  state.shift = nil
end

-- A count walked so far is thrown away when entries it counted may be gone: deleted (max-deleted-entry-id moved
-- past its start) or trimmed (the first entry moved past its start).
local function stale(walk)
  if not walk then return false end
  if deleted ~= state.deleted and cmp(deleted, walk.after) > 0 then return true end
  return first ~= nil and first ~= state.first and cmp(first, walk.after) > 0
end
if stale(state.to) or stale(state.lagwalk) then
  state.to, state.lagwalk = nil, nil
  state.restarts = state.restarts + 1
end
state.deleted, state.first = deleted, first or ''

-- The entries after the target: known without walking after the last id and before the first entry.
local position = state.position or last_generated
local to_after
if position == last_generated then
  to_after = 0
elseif not first or cmp(position, first) < 0 then
  to_after = tonumber(stream['length'])
end
-- And after the group's position now: its lag, where the server reports it.
local from_id = info['last-delivered-id']
local from_after = info['lag'] and tonumber(info['lag']) or nil
if from_id == position then from_after = to_after end
local exact = state.restarts <= RESTARTS
if exact then
  if not to_after then
    state.to = state.to or new_walk(position)
    if not advance(state.to) then return save() end
    to_after = state.to.n
  end
  if not from_after then
    if not state.lagwalk or state.lagwalk.after ~= from_id then state.lagwalk = new_walk(from_id) end
    if not advance(state.lagwalk) then return save() end
    from_after = state.lagwalk.n
  end
elseif state.handled == 0 then
  return refused('StreamChanging', 'entries of ' .. src .. ' were deleted or trimmed while the seek counted ' ..
    'them, ' .. state.restarts .. ' times: nothing moved; seek when the stream is quieter')
end

-- The pending entries, a batch per call, before the move.
local last_batch = true
if pending_mode ~= 'Keep' and not dry_run then
  if state.handled == 0 then
    local reason, message = refusal(state.start)
    if reason then return refused(reason, message) end
  end
  local page = redis.call('XPENDING', src, group, state.pending, '+', PENDING_BATCH)
  local has_errors = pending_mode == 'DeadLetter' and redis.call('EXISTS', errors) == 1
  local acks, dead_lettered, gone = {}, 0, 0
  local function handle()
    for _, p in ipairs(page) do
      if pending_mode == 'DeadLetter' and spent() then return end
      local id, owner, deliveries = p[1], p[2], p[4]
      if pending_mode == 'DeadLetter' then
        local entry = read('XRANGE', id, id, 1)[1]
        if entry then
          local fields = entry[2]
          local n = #fields
          -- A requeued copy ends with Pelican's own two fields: the message is its origin, with its deliveries.
          local origin, earlier = id, 0
          if n >= 4 and fields[n - 3] == 'pelican-origin-id' and fields[n - 1] == 'pelican-deliveries' then
            origin, earlier, n = fields[n - 2], tonumber(fields[n]) or 0, n - 4
          end
          local args = {dlq}
          if dlq_maxlen > 0 then args[2] = 'MAXLEN'; args[3] = '~'; args[4] = ARGV[10] end
          args[#args + 1] = '*'
          local a = #args
          for f = 1, n do args[a + f] = fields[f] end
          a = a + n
          args[a + 1] = 'pelican-source-stream'; args[a + 2] = src
          args[a + 3] = 'pelican-source-id'; args[a + 4] = id
          args[a + 5] = 'pelican-origin-id'; args[a + 6] = origin
          args[a + 7] = 'pelican-group'; args[a + 8] = group
          args[a + 9] = 'pelican-consumer'; args[a + 10] = owner
          args[a + 11] = 'pelican-deliveries'; args[a + 12] = string.format('%d', earlier + deliveries)
          args[a + 13] = 'pelican-reason'; args[a + 14] = 'Seek'
          args[a + 15] = 'pelican-dead-lettered-at'; args[a + 16] = string.format('%d', now_ms)
          local last_error = has_errors and redis.call('HGET', errors, id)
          if last_error then
            args[a + 17] = 'pelican-last-error'; args[a + 18] = string.sub(last_error, 1, error_max)
          end
          redis.call('XADD', unpack(args))
          if last_error then redis.call('HDEL', errors, id) end
          dead_lettered = dead_lettered + 1
        else
          gone = gone + 1
        end
      end
      acks[#acks + 1] = id
    end
  end
  -- The dead letters written stand also when a command failed half way (an out-of-memory XADD): their originals
  -- are acknowledged and the cursor recorded before the error is returned.
  local ok, failure = pcall(handle)
  if #acks > 0 then
    redis.call('XACK', src, group, unpack(acks))
    state.pending = '(' .. acks[#acks]
    state.handled = state.handled + #acks
  end
  if dead_lettered > 0 then redis.call('HINCRBY', totals, 'deadLettered', dead_lettered) end
  if gone > 0 then redis.call('HINCRBY', totals, 'payloadDeleted', gone) end
  if not ok then
    save()
    return redis.error_reply(type(failure) == 'table' and failure.err or tostring(failure))
  end
  last_batch = #acks == #page and #page < PENDING_BATCH
end
if not last_batch then return save() end

-- The move.
if pending_mode == 'Keep' or dry_run then
  local reason, message = refusal(state.start)
  if reason then return refused(reason, message) end
end
local entries_read = exact and (added - to_after) or nil
local result = {
  from = {id = from_id, entriesRead = info['entries-read'], lag = info['lag']},
  to = {id = position, entriesRead = entries_read or false, lag = exact and to_after or false},
  redelivered = exact and math.max(0, to_after - from_after) or 0,
  skipped = exact and math.max(0, from_after - to_after) or 0,
  pendingHandled = dry_run and (pending_mode ~= 'Keep' and tonumber(info['pending']) or 0) or state.handled,
  oldestAvailable = first,
  dryRun = dry_run,
}
if dry_run then
  redis.call('HDEL', seeks, name)
else
  if entries_read then
    redis.call('XGROUP', 'SETID', src, group, position, 'ENTRIESREAD', string.format('%d', entries_read))
  else
    redis.call('XGROUP', 'SETID', src, group, position)
  end
  redis.call('HSET', seeks, name, cjson.encode({uid = uid, result = result}))
end
return {'done', cjson.encode(result)}
