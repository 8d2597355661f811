-- Redrive one step: read the next dead letters of the range, move them, and record the progress, in one script.
--
-- KEYS[1] dead-letter stream    KEYS[2] the redrive's progress hash    KEYS[3] the stream's redrive lock
-- KEYS[4..] the destination streams the caller has checked so far (the only streams this call writes)
-- ARGV[1] the redrive's uid     ARGV[2] its name (written as `pelican-redrive` on each moved entry)
-- ARGV[3] where to start reading: '-', an id (inclusive), or '(' and the last id already covered
-- ARGV[4] the last id of the range (inclusive)
-- ARGV[5] most entries to move in this call
-- ARGV[6] most fields an entry may have to be moved    ARGV[7] byte budget: the call stops after copying this much
--         (each field counts FIELD_COST bytes beyond its length)
-- ARGV[8] where entries go: 'stream' (all to KEYS[4]) or 'source' (each to its `pelican-source-stream`)
-- ARGV[9] with 'source': where an entry without `pelican-source-stream` goes
-- ARGV[10] '1' when the operator traces (SPEC 23): the reply then says what became of each message moved
-- ARGV[11..] the `pelican-reason` values to move (all entries when there are none)
--
-- Returns {moved, tooLarge, left, finished, lastId, need, moves}: `moves` is empty unless ARGV[10] asks for it; then
-- one {dead letter id, new id, target stream, traceparent, tracestate, reason, deliveries} per entry moved (the trace
-- fields '' when it carries none). `lastId` is the last id covered (moved or left
-- in place; '' when none was), `left` the entries outside the filter, `finished` 1 when the range is exhausted (the
-- lock is then released with the record of the end). `need` is '' or a destination stream not in KEYS: the call
-- stopped before the entry that goes there, and the caller checks the stream and calls again with it in KEYS.
-- When a move fails (an out-of-memory XADD, a target whose last id is the largest possible), the moves before it
-- are recorded, and the failure is returned as an error: the next call starts at the failing id again.
--
-- Entries are read a run at a time with one XRANGE: one entry first, then as many as the byte budget holds at the
-- size seen so far (at most the entries still to move, without a filter). Reading costs the server too: a call
-- stops once it read READ_MAX entries or the byte budget's worth, whatever it moved, so a filter that matches little
-- never holds the server; `lastId` says how far it got.
--
-- Invariant: every id ends either moved (one entry in its target: the application's fields, the `pelican-*`
-- metadata stripped, then `pelican-redriven-from` <id> and `pelican-redrive` <name>; the dead letter deleted) or
-- still in the dead-letter stream, never both and never neither, and the progress hash moves with the entries in
-- the same call, also when the call fails half way, so a caller that dies at any instant resumes after exactly
-- what was done. Key types, the owner of the progress hash and the holder of the stream's lock are checked before
-- the first write; each copy is written before the XDEL of its original.
local dlq, progress, lock = KEYS[1], KEYS[2], KEYS[3]
local uid, name, start, until_id = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local budget, max_fields, byte_budget = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local to_source, fallback = ARGV[8] == 'source', ARGV[9]
local RUN = 256
local READ_MAX = 4096
-- What a field costs beyond its bytes, charged to the byte budget (reading and copying alike): a field costs the
-- server about what 512 bytes of its value do,
-- so an entry of thousands of empty fields is no longer free (`benches/call_cost.rs`: a field costs 0.3-0.6 us, a
-- byte about 1 ns).
local FIELD_COST = 512

local function expect_type(key, wanted)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= wanted then
    return redis.error_reply('WRONGTYPE key ' .. key .. ' holds a ' .. t .. ', not a ' .. wanted)
  end
end
local bad = expect_type(dlq, 'stream') or expect_type(progress, 'hash')
if bad then return bad end
local target_of = {}
for i = 4, #KEYS do
  bad = expect_type(KEYS[i], 'stream')
  if bad then return bad end
  target_of[KEYS[i]] = KEYS[i]
end
local owner = redis.call('HGET', progress, 'uid')
if owner and owner ~= uid then
  return redis.error_reply('OWNED progress ' .. progress .. ' belongs to another redrive (uid ' .. owner .. ')')
end
-- The stream's lock names the one redrive that may move: a task of a deleted object whose name a new object took
-- moves nothing once the new one holds the lock.
local holder = redis.call('HGET', lock, 'uid')
if holder and holder ~= uid then
  return redis.error_reply('OWNED lock ' .. lock .. ' belongs to another redrive (uid ' .. holder .. ')')
end
local reasons = nil
local traced = ARGV[10] == '1'
local moves = {}
for i = 11, #ARGV do
  reasons = reasons or {}
  reasons[ARGV[i]] = true
end

-- The counts cannot fail after a move: a field that holds no integer (any client can write one) restarts at 0.
local counts = redis.call('HMGET', progress, 'moved', 'skipped', 'tooLarge')
for i, field in ipairs({'moved', 'skipped', 'tooLarge'}) do
  local v = counts[i]
  if v and (not string.match(v, '^%d+$') or #v > 17) then redis.call('HSET', progress, field, 0) end
end

local moved, too_large, left, copied = 0, 0, 0, 0
local last_id, need, finished = nil, '', false
local read_bytes, read_entries = 0, 0

-- The value of `field` among an entry's fields, or nil.
local function field_value(fields, field)
  for f = 1, #fields, 2 do
    if fields[f] == field then return fields[f + 1] end
  end
end

-- Moves one entry; false when the call must stop before it (a destination the caller has not checked).
local function take(id, fields)
  if reasons and not reasons[field_value(fields, 'pelican-reason') or ''] then
    left = left + 1
    return true
  end
  local target = KEYS[4]
  if to_source then
    local stream = field_value(fields, 'pelican-source-stream') or fallback
    target = target_of[stream]
    if not target then
      need = stream
      return false
    end
  end
  if #fields > max_fields then
    too_large = too_large + 1
    return true
  end
  local args = {target, '*'}
  for f = 1, #fields, 2 do
    if string.sub(fields[f], 1, 8) ~= 'pelican-' then
      args[#args + 1] = fields[f]; args[#args + 1] = fields[f + 1]
      copied = copied + #fields[f] + #fields[f + 1] + 2 * FIELD_COST
    end
  end
  args[#args + 1] = 'pelican-redriven-from'; args[#args + 1] = id
  args[#args + 1] = 'pelican-redrive'; args[#args + 1] = name
  local copy = redis.call('XADD', unpack(args))
  redis.call('XDEL', dlq, id)
  moved = moved + 1
  if traced then
    moves[#moves + 1] = {id, copy, target, field_value(fields, 'traceparent') or '', field_value(fields, 'tracestate') or '',
      field_value(fields, 'pelican-reason') or '', field_value(fields, 'pelican-deliveries') or '0'}
  end
  return true
end

local function step()
  while moved < budget do
    if copied >= byte_budget or read_entries >= READ_MAX or read_bytes >= byte_budget then return end
    -- One entry until a size was seen; then as many as the rest of the byte budget holds (every byte read counts,
    -- also of entries the filter leaves), at most RUN.
    local count = 1
    if read_entries > 0 then
      local average = math.max(1, math.floor(read_bytes / read_entries))
      count = math.max(1, math.min(RUN, math.floor((byte_budget - read_bytes) / average)))
    end
    -- Without a filter every entry read is moved (or stops the call): read no more than the budget needs.
    if not reasons then count = math.min(count, budget - moved) end
    local run = redis.call('XRANGE', dlq, start, until_id, 'COUNT', count)
    for _, entry in ipairs(run) do
      local fields = entry[2]
      for f = 1, #fields do read_bytes = read_bytes + #fields[f] + FIELD_COST end
      read_entries = read_entries + 1
    end
    for _, entry in ipairs(run) do
      if moved >= budget or (copied >= byte_budget and last_id) then return end
      if not take(entry[1], entry[2]) then return end
      last_id = entry[1]
    end
    if #run < count then
      finished = true
      return
    end
    start = '(' .. run[#run][1]
  end
end

local ok, failure = pcall(step)
if budget == 0 then finished = true end
if last_id then
  redis.call('HSET', progress, 'uid', uid, 'lastId', last_id)
else
  redis.call('HSET', progress, 'uid', uid)
end
redis.call('HINCRBY', progress, 'moved', moved)
redis.call('HINCRBY', progress, 'skipped', left + too_large)
redis.call('HINCRBY', progress, 'tooLarge', too_large)
if not ok then
  return redis.error_reply(type(failure) == 'table' and failure.err or tostring(failure))
end
if finished then
  local now = redis.call('TIME')
  redis.call('HSET', progress, 'finishedAt', string.format('%d', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
  if redis.call('HGET', lock, 'uid') == uid then redis.call('DEL', lock) end
end
return {moved, too_large, left, finished and 1 or 0, last_id or '', need, moves}
