-- Reclaim / dead-letter: scan one page of a group's PEL and handle what is idle in it.
--
-- KEYS[1] source stream    KEYS[2] dead-letter stream    KEYS[3] totals hash    KEYS[4] terminal hash
-- KEYS[5] errors hash: entry id -> the text of its last failure, written by workers
-- KEYS[6] hand-overs hash: entry id -> when Reassign last handed it over (ms)
-- KEYS[7] heartbeats hash: consumer -> its worker's last lease tick (ms, the server's time; contract/README.md)
-- ARGV[1] group            ARGV[2] min idle (ms)         ARGV[3] max deliveries
-- ARGV[4] strategy: Requeue | Reassign | DeadLetterOnly  ARGV[5] dead-letter MAXLEN (0: no cap)
-- ARGV[6] the operator's consumer name                   ARGV[7] most fields an entry may have to be moved
-- ARGV[8] byte budget: after reading this many bytes the script stops, and the next call goes on from there (each
--         field counts FIELD_COST bytes beyond its length)
-- ARGV[9] backoff factor   ARGV[10] backoff max (ms; 0: no backoff)   ARGV[11] most bytes of an error text kept
-- ARGV[12] where the page starts: '-' (the PEL's first entry) or '(' followed by the last id already looked at
-- ARGV[13] most PEL entries to look at
-- ARGV[14] hand-over grace (ms): an entry Reassign handed over is not handed over again sooner
-- ARGV[15] how long ago (ms) the consumers below were found without a Pod
-- ARGV[16] most consumers the group may have for Reassign to list them (XINFO CONSUMERS)
-- ARGV[17] '1' when the operator traces (SPEC 23): the reply then says what became of each message moved
-- ARGV[18] k, the number of consumers whose Pod is gone (`spec.consumers.pods`; at most 100), then their k names
-- ARGV[19+k..] pairs: the id of a requeued copy and the deliveries it carries from before it was requeued, as earlier
--           calls found them (see Backoff)
--
-- Returns {requeued, reassigned, deadLettered, payloadDeleted, skipped, tooLarge, scanned, deadLetterEvicted, idle,
-- position, reachedEnd, known, unlisted, moves, id, earlier, id, earlier, ...}: `scanned` PEL entries were looked at, up to and
-- including `position` (the next call starts after it; '' when none was), of which `idle` were idle long enough to
-- be taken and `skipped` of those were left alone; `reachedEnd` is 1 when the page was the PEL's last. `unlisted` is
-- the group's number of consumers when Reassign needed them listed and there were more than ARGV[16] (0 otherwise).
-- `known` has one character per pair of ARGV[18+k..]: 'w' the copy is in the page and still waits, 't' it was in the page and
-- read (moved, or returned again below), '-' not in the part of the page looked at. The pairs name the requeued
-- copies read and found not due, with the deliveries each carries from before. `moves` is empty unless ARGV[17] asks
-- for it; then one {what, id, to, traceparent, tracestate, reason, deliveries} per message moved ('requeued',
-- 'reassigned' or 'deadLettered'; `to` the copy's or dead letter's id, or the consumer handed to; the trace fields ''
-- when the message carries none): at most one per entry of the page, each of a few short strings.
--
-- The scan is plain extended XPENDING from the position, never the IDLE filter, which walks the whole PEL on the
-- server: a call costs the same on a PEL of a thousand entries or a million. Entries are read a run at a time
-- with one XRANGE from the first one needed, as many as the rest of the byte budget allows (one until the first
-- entry tells their size) and no more than the last run served: a drain's PEL is mostly consecutive entries, so
-- one read serves many, while a PEL whose entries lie apart in the stream is read an entry at a time. Every byte
-- read is charged to the budget, whether it was moved, read ahead for nothing or too large to move. The originals the call moved are acknowledged with one XACK at the end.
--
-- An entry owned by a consumer whose Pod is gone is taken whatever its idle time (its delivery counted as it is: a Pod
-- may have died of its message), unless it was read after the consumer was found gone (ARGV[15]: a Pod recreated
-- under the same name, a StatefulSet's, read it), and no entry is handed over to such a consumer. So is an entry without an owner:
-- what `XNACK` (Redis 8.8) leaves (consumer '', idle -1 until read again), a worker giving it back; its count as the
-- NACK left it (SILENT: the aborted delivery uncounted; FAIL: counted; FATAL: past the cap, dead-lettered).
--
-- An entry delivered more than `max deliveries` times is taken whatever its idle time, and dead-lettered: only
-- clients that read or claim it by themselves raise its count past the cap (Pelican's own hand-overs and the SDK's
-- leases never do), and their claims keep it from going idle. For a requeued copy the count includes its earlier
-- deliveries (`pelican-deliveries`): a copy delivered twice or more is read even when busy, to know them.
--
-- Backoff: an entry is taken once idle min(max, minIdle * factor^(n-1)), n counting every delivery of the message
-- (a requeued copy's `pelican-deliveries` plus its own count). The scan knows the entry's own count, plus what
-- the caller sends of a copy's earlier deliveries: a lower bound, and the exact check is made once the entry is
-- read. A copy found not due is returned with its earlier deliveries, so that the caller sends them with the next
-- sweep's call and the scan leaves the copy alone without reading it until it is due. An entry not due is
-- skipped, never waited for. The threshold is computed in closed form, so a forged count (`XCLAIM ... RETRYCOUNT`,
-- a producer's own `pelican-deliveries`) costs what any count costs; a `pelican-deliveries` that is no finite
-- non-negative integer is taken as the cap and dead-lettered with reason `InvalidDeliveryCount`. A count of the
-- server's own at 2^53 or more is what `XNACK ... FATAL` (Redis 8.8) pins (i64 max): the worker said the message is
-- poison, and it is dead-lettered at once with reason `NackedFatal`.
-- The last error follows the message: to the requeued copy's new id, or into the dead letter as `pelican-last-error`
-- (cut to ARGV[11] bytes); its field goes when the entry leaves the PEL here, and a few fields of entries no longer
-- pending (ACKed by a client that left its field) are removed per call, so the hash shrinks back to the PEL.
--
-- Invariant: every id ends as exactly one of: untouched and still pending; requeued (one copy at the tail, the
-- original acknowledged); claimed by a live consumer; dead-lettered (one entry, the original acknowledged); or
-- dropped from the PEL because its payload is gone. Scripts are not rolled back on error, so every key type and the
-- group are checked before the first write, every copy is written before the XACK that retires its original, and
-- the XACK runs also when a command failed half way (an out-of-memory XADD): the copies made stand, their
-- originals go. The pending state is read in the same atomic call that moves the entry, so a consumer that ACKed
-- or re-read an entry before the call wins. Counting cannot fail after a move (counter fields that hold no integer
-- are reset before the first move, instead of making an HINCRBY raise an error half way through the call). The
-- byte budget keeps one call short, so other clients of the server never see BUSY because of large entries.
-- Reassign hands an entry over with its delivery count raised by one (RETRYCOUNT), so the retry cap holds even
-- when the new owner never re-reads its PEL; a hand-over is counted only when the claim took the entry. A consumer
-- is live when its worker's heartbeat (KEYS[7], written by the contract's lease.lua at every lease tick) is younger
-- than minIdle and its Pod is not gone. Never by its XINFO idle time: this script's own XCLAIM to a consumer resets
-- it (one phantom hand-over keeps a dead consumer looking live for the next), and a server loading its AOF starts
-- every consumer's again. With no live consumer, Reassign requeues instead; so it does when the
-- group has more consumers than ARGV[16]: XINFO CONSUMERS lists them all, each made a Lua table, and would hold the
-- server for as long as there are. The live consumers are listed once per call, and the hand-overs go to the
-- CANDIDATES least loaded of them, so a due entry costs a look at a few consumers, not at every one.

local src, dlq, totals, terminal, errors, handovers = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local heartbeats = KEYS[7]
local group = ARGV[1]
local min_idle = tonumber(ARGV[2])
local max_deliveries = tonumber(ARGV[3])
local strategy = ARGV[4]
local dlq_maxlen = tonumber(ARGV[5])
local operator = ARGV[6]
local max_fields = tonumber(ARGV[7])
local byte_budget = tonumber(ARGV[8])
local factor, max_wait, error_max = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
local start, limit, grace = ARGV[12], tonumber(ARGV[13]), tonumber(ARGV[14])
-- Consumers whose Pod is gone, by name.
local gone_age, gone, pairs_from = tonumber(ARGV[15]), {}, 19 + tonumber(ARGV[18])
for i = 19, pairs_from - 1 do gone[ARGV[i]] = true end
local traced = ARGV[17] == '1'
local max_consumers = tonumber(ARGV[16])
-- Copy id -> index of its pair; what became of each, as the reply tells it.
local known, fate = {}, {}
for i = pairs_from, #ARGV, 2 do known[ARGV[i]] = i end
-- The most entries one XRANGE reads.
local RUN = 64
-- The live consumers Reassign hands over to: the least loaded, listed once per call.
local CANDIDATES = 16
-- What a field costs beyond its bytes, charged to the byte budget: reading and copying a field costs the server
-- about what 512 bytes of its value do,
-- so an entry of thousands of empty fields is no longer free (`benches/call_cost.rs`: a field costs 0.3-0.6 us, a
-- byte about 1 ns).
local FIELD_COST = 512

local function expect_type(key, wanted)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= wanted then
    return redis.error_reply('WRONGTYPE key ' .. key .. ' holds a ' .. t .. ', not a ' .. wanted)
  end
end
local bad = expect_type(src, 'stream') or expect_type(dlq, 'stream')
  or expect_type(totals, 'hash') or expect_type(terminal, 'hash') or expect_type(errors, 'hash')
  or expect_type(handovers, 'hash') or expect_type(heartbeats, 'hash')
if bad then return bad end
-- Raises NOGROUP before any write when the group is gone.
local page = redis.call('XPENDING', src, group, start, '+', limit)

local now = redis.call('TIME')
local now_ms = string.format('%d', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))

-- Counting cannot fail after a move: a counter field that holds no integer (any client can write one) is set to
-- 0 here, before the first move, so the HINCRBYs below always succeed. Prometheus reads it as a counter reset.
local function sanitize(key, fields)
  local values = redis.call('HMGET', key, unpack(fields))
  for i, v in ipairs(values) do
    if v and (not string.match(v, '^-?%d+$') or #v > 17) then redis.call('HSET', key, fields[i], 0) end
  end
end
sanitize(totals, {'requeued', 'reassigned', 'deadLettered', 'payloadDeleted', 'deadLetterEvicted'})
sanitize(terminal, {'MaxDeliveriesExceeded', 'InvalidDeliveryCount', 'NackedFatal', 'PayloadDeleted'})

local requeued, reassigned, dead_lettered, payload_deleted, skipped, too_large, invalid_counts = 0, 0, 0, 0, 0, 0, 0
local fatal_counts = 0
local scanned, idle, evicted = 0, 0, 0
-- Entries not idle whose fields were read all the same (a copy delivered again while busy: its earlier deliveries).
local peeked = 0
-- The originals to acknowledge at the end: `src`, `group`, then ids.
local acks = {src, group}
-- Requeued copies not due: id, earlier deliveries, ...
local waiting = {}

-- The group's consumers when Reassign needed them listed and there were too many (see the header).
local unlisted = 0
-- The group's entry of XINFO GROUPS (which costs what the stream's groups cost, not its consumers).
local function group_info()
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', src)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    if info['name'] == group then return info end
  end
  return {}
end
-- Live consumers and their PEL sizes, read once per call, for Reassign: the CANDIDATES least loaded.
local live
local function least_loaded(except)
  if not live then
    live = {}
    local count = tonumber(group_info()['consumers']) or 0
    local listed = {}
    if count > max_consumers then unlisted = count else listed = redis.call('XINFO', 'CONSUMERS', src, group) end
    local candidates, names = {}, {}
    for _, c in ipairs(listed) do
      local info = {}
      for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
      local name = info['name']
      if name ~= operator and name ~= '' and not gone[name] then
        candidates[#candidates + 1] = {name = name, pending = tonumber(info['pending'])}
        names[#names + 1] = name
      end
    end
    -- At most CONSUMERS_LISTED_MAX names, like the listing itself.
    local beats = #names > 0 and redis.call('HMGET', heartbeats, unpack(names)) or {}
    for i, c in ipairs(candidates) do
      local beat = tonumber(beats[i])
      if beat and tonumber(now_ms) - beat < min_idle then live[#live + 1] = c end
    end
    table.sort(live, function(a, b) return a.pending < b.pending end)
    for i = #live, CANDIDATES + 1, -1 do live[i] = nil end
  end
  local best, owner
  for _, c in ipairs(live) do
    if c.name == except then owner = c end
    if c.name ~= except and (best == nil or c.pending < best.pending) then best = c end
  end
  -- With the owner the only live consumer, the entry goes back to it: a worker that reads only new entries (the
  -- SDK leaves its failures to the pass) takes what it is handed at its next look at its PEL.
  return best or owner
end

-- The idle time an entry delivered n times must reach before it is taken: min(max, minIdle * factor^(n-1)), in
-- closed form. n is data clients control (XCLAIM ... RETRYCOUNT, a producer's `pelican-deliveries`): a loop over it
-- would hold the server for as long as the count is large, or forever.
local function threshold(n)
  if max_wait == 0 or n <= 1 or factor <= 1 then return min_idle end
  local wait = min_idle * factor ^ (n - 1)
  if wait ~= wait or wait >= max_wait then return math.max(max_wait, min_idle) end
  return wait
end

-- The largest delivery count taken as it is: above it a Lua number no longer holds every integer.
local MAX_COUNT = 2 ^ 53
-- A delivery count read from an entry's `pelican-deliveries` field: the number, or nil when it is no finite
-- non-negative integer (`inf`, `nan`, `-1`, `1.5`, `1e300`, text).
local function delivery_count(text)
  local n = tonumber(text)
  if n == nil or n ~= n or n < 0 or n >= MAX_COUNT or n ~= math.floor(n) then return nil end
  return n
end

-- Most streams have no errors hash (no worker records errors): then no entry costs a lookup. Likewise hand-overs.
local has_errors = redis.call('EXISTS', errors) == 1
local has_handovers = redis.call('EXISTS', handovers) == 1

-- The entries read so far (id -> fields) from the last run, and what the reads told of their size.
local run, read_bytes, read_entries = {}, 0, 0
-- How many entries the next run reads ahead, and how many of the last run's were wanted: a PEL whose entries lie
-- far apart in the stream (one pending in 64: a poison storm) reads one entry a run, not 64 to use one.
local ahead, run_size, run_used = RUN, 0, 0
-- The fields of entry `id`, or nil when the stream no longer holds it. `last` is the page's last id: no run reads
-- past it.
local function fields_of(id, last)
  local fields = run[id]
  if fields then
    run_used = run_used + 1
    return fields
  end
  if run_size > 0 then
    -- The read-ahead follows the PEL's own gaps: it halves to what the last run served and doubles while it
    -- served every entry it read.
    if run_used < run_size then ahead = math.max(1, run_used) else ahead = math.min(RUN, ahead * 2) end
  end
  -- As many entries as the rest of the budget holds at the size seen so far; one until a size was seen.
  local count = 1
  if read_entries > 0 then
    local average = math.max(1, math.floor(read_bytes / read_entries))
    count = math.max(1, math.min(ahead, math.floor((byte_budget - read_bytes) / average)))
  end
  run, run_size, run_used = {}, 0, 1
  for _, entry in ipairs(redis.call('XRANGE', src, id, last, 'COUNT', count)) do
    local f = entry[2]
    for i = 1, #f do read_bytes = read_bytes + #f[i] + FIELD_COST end
    read_entries = read_entries + 1
    run_size = run_size + 1
    run[entry[1]] = f
  end
  return run[id]
end

-- What became of each message moved, when the operator traces: see the reply.
local moves = {}
-- Records a move with the message's trace context (its `traceparent` / `tracestate` among its first n fields).
local function moved(what, id, to, fields, n, reason, total)
  if not traced then return end
  local parent, state = '', ''
  for f = 1, n - 1, 2 do
    if fields[f] == 'traceparent' then parent = fields[f + 1] elseif fields[f] == 'tracestate' then state = fields[f + 1] end
  end
  moves[#moves + 1] = {what, id, to, parent, state, reason, string.format('%d', total)}
end

-- A copy of the message at the end of the stream, carrying its origin and deliveries, and its last error under the
-- copy's id; the original is acknowledged at the end of the call.
local function requeue(id, fields, n, origin, total)
  local args = {src, '*'}
  for f = 1, n do args[f + 2] = fields[f] end
  args[n + 3] = 'pelican-origin-id'; args[n + 4] = origin
  args[n + 5] = 'pelican-deliveries'; args[n + 6] = string.format('%d', total)
  local copy = redis.call('XADD', unpack(args))
  acks[#acks + 1] = id
  if has_errors then
    local last_error = redis.call('HGET', errors, id)
    if last_error then
      redis.call('HDEL', errors, id)
      redis.call('HSET', errors, copy, last_error)
    end
  end
  requeued = requeued + 1
  moved('requeued', id, copy, fields, n, '', total)
end

-- Whether `Reassign` handed entry `id` over less than the grace ago.
local function handed_within_grace(id)
  if strategy ~= 'Reassign' or not has_handovers then return false end
  local handed = tonumber(redis.call('HGET', handovers, id))
  return handed ~= nil and tonumber(now_ms) - handed < grace
end

-- Every move of the call; the acknowledgements and the counters are written once, below.
local position = ''
local function move_page()
for _, pending in ipairs(page) do
  -- Every byte read counts, also of entries read ahead and not pending, and of entries too large to move.
  if (idle > 0 or peeked > 0) and read_bytes >= byte_budget then return end
  local id, owner, idle_ms, deliveries = pending[1], pending[2], pending[3], pending[4]
  scanned = scanned + 1
  position = id
  local copy = known[id]
  local carried = copy and delivery_count(ARGV[copy + 1]) or 0
  -- Past the cap, an entry is taken whatever its idle time: a client that claims by itself (XAUTOCLAIM, or
  -- XREADGROUP ... CLAIM, with a shorter idle than the policy's) keeps it from ever going idle, each claim a delivery.
  local orphan = (gone[owner] == true and idle_ms >= gone_age) or owner == ''
  local quiet = idle_ms < threshold(deliveries + carried) and deliveries + carried <= max_deliveries and not orphan
  if quiet and not copy and deliveries >= 2 then
    -- Delivered again without going idle: a worker that claims by itself keeps a requeued copy busy, and the
    -- copy's earlier deliveries are only in its fields. Read them, or such a copy would never reach the cap.
    peeked = peeked + 1
    local fields = fields_of(id, page[#page][1])
    local n = fields and #fields or 0
    if n >= 4 and fields[n - 3] == 'pelican-origin-id' and fields[n - 1] == 'pelican-deliveries' then
      local earlier = delivery_count(fields[n])
      quiet = earlier ~= nil and earlier + deliveries <= max_deliveries
    end
  end
  if quiet then
    if copy then fate[copy] = 'w' end
  else
    if copy then fate[copy] = 't' end
    idle = idle + 1
    local fields = fields_of(id, page[#page][1])
    if fields == nil then
      -- Deleted or trimmed while pending: a stale reference, not a message.
      acks[#acks + 1] = id
      if has_errors then redis.call('HDEL', errors, id) end
      payload_deleted = payload_deleted + 1
    else
      local n = #fields
      -- A copy requeued earlier ends with Pelican's own two fields; the application's fields come before them.
      local origin, earlier, invalid = id, 0, false
      if n >= 4 and fields[n - 3] == 'pelican-origin-id' and fields[n - 1] == 'pelican-deliveries' then
        origin, earlier, n = fields[n - 2], delivery_count(fields[n]), n - 4
        -- A count no retry ever wrote: the message has had its retries (the cap), and the dead letter says why.
        invalid = earlier == nil
        earlier = earlier or 0
      end
      local total = earlier + deliveries
      local fatal = deliveries >= MAX_COUNT
      if invalid or total >= MAX_COUNT then invalid, total = not fatal, max_deliveries end
      if idle_ms < threshold(total) and total <= max_deliveries and not orphan then
        -- Backoff: not due yet.
        skipped = skipped + 1
        if earlier > 0 then waiting[#waiting + 1] = id; waiting[#waiting + 1] = earlier end
      elseif n > max_fields then
        too_large = too_large + 1
      elseif total <= max_deliveries and handed_within_grace(id) then
        -- Handed over within the grace: its new owner has not had its look at its PEL yet. Also when the hand-over
        -- was its last delivery: dead-lettering it now would take the delivery the hand-over counted from it.
        skipped = skipped + 1
      elseif total >= max_deliveries then
        local args = {dlq}
        if dlq_maxlen > 0 then
          -- The text of ARGV[5], not the Lua number, which large values would turn into 1e+15.
          args[2] = 'MAXLEN'; args[3] = '~'; args[4] = ARGV[5]
        end
        args[#args + 1] = '*'
        local a = #args
        for f = 1, n do args[a + f] = fields[f] end
        a = a + n
        args[a + 1] = 'pelican-source-stream'; args[a + 2] = src
        args[a + 3] = 'pelican-source-id'; args[a + 4] = id
        args[a + 5] = 'pelican-origin-id'; args[a + 6] = origin
        args[a + 7] = 'pelican-group'; args[a + 8] = group
        args[a + 9] = 'pelican-consumer'; args[a + 10] = owner
        args[a + 11] = 'pelican-deliveries'; args[a + 12] = string.format('%d', total)
        local reason = fatal and 'NackedFatal' or invalid and 'InvalidDeliveryCount' or 'MaxDeliveriesExceeded'
        args[a + 13] = 'pelican-reason'; args[a + 14] = reason
        args[a + 15] = 'pelican-dead-lettered-at'; args[a + 16] = now_ms
        local last_error = has_errors and redis.call('HGET', errors, id)
        if last_error then
          args[a + 17] = 'pelican-last-error'; args[a + 18] = string.sub(last_error, 1, error_max)
        end
        local letter
        if dlq_maxlen > 0 then
          -- MAXLEN may drop older dead letters to make room: count them, they vanish from the one place people
          -- look for them.
          local before = redis.call('XLEN', dlq)
          letter = redis.call('XADD', unpack(args))
          evicted = evicted + before + 1 - redis.call('XLEN', dlq)
        else
          letter = redis.call('XADD', unpack(args))
        end
        moved('deadLettered', id, letter, fields, n, reason, total)
        acks[#acks + 1] = id
        if last_error then redis.call('HDEL', errors, id) end
        dead_lettered = dead_lettered + 1
        if invalid then invalid_counts = invalid_counts + 1 end
        if fatal then fatal_counts = fatal_counts + 1 end
      elseif strategy == 'Requeue' then
        requeue(id, fields, n, origin, total)
      elseif strategy == 'Reassign' then
        local target = least_loaded(owner)
        if target then
          -- A hand-over is a delivery: without RETRYCOUNT, JUSTID leaves the count as it was, and an entry handed
          -- to consumers that never re-read their PEL would be reassigned forever, never reaching the cap. It is
          -- not handed over again within the grace, so the count grows no faster than the owner can take it up.
          -- Min-idle 0: this call found the entry due (a gone owner's and an unowned one whatever their idle
          -- time) and nothing ran since; with minIdle there the claim of those silently did nothing.
          local claimed = redis.call('XCLAIM', src, group, target.name, 0, id, 'RETRYCOUNT', deliveries + 1, 'JUSTID')
          if claimed[1] then
            redis.call('HSET', handovers, id, now_ms)
            has_handovers = true
            target.pending = target.pending + 1
            reassigned = reassigned + 1
            moved('reassigned', id, target.name, fields, n, '', deliveries + 1)
          else
            skipped = skipped + 1
          end
        else
          -- No consumer looks live: a worker waiting on new entries looks idle on Redis 7.0 (an empty read does
          -- not reset `idle` before 7.2), and a group whose workers all left has none. A copy at the end of the
          -- stream reaches whoever reads next, as under Requeue.
          requeue(id, fields, n, origin, total)
        end
      else
        skipped = skipped + 1
      end
    end
  end
end
end

-- Whether stream id `a` comes after `b` (ids are `<ms>-<seq>`).
local function after(a, b)
  local a_ms, a_seq = string.match(a, '^(%d+)-(%d+)$')
  local b_ms, b_seq = string.match(b, '^(%d+)-(%d+)$')
  if not (a_ms and b_ms) then return false end
  if #a_ms ~= #b_ms then return #a_ms > #b_ms end
  if a_ms ~= b_ms then return a_ms > b_ms end
  return tonumber(a_seq) > tonumber(b_seq)
end

-- The group's last-delivered-id: entries after it were never read by the group.
local function last_delivered()
  return group_info()['last-delivered-id'] or '0-0'
end

-- Fields of entries that left the PEL without Pelican (a client ACKed and left its field): a few per call. A field
-- whose entry is in the stream and not read yet stays: a requeued copy carries its original's last error until a
-- consumer reads it, so a final delivery that records nothing still dead-letters with the error of the one before.
local function prune_errors()
  if not has_errors then return end
  local delivered
  for _, id in ipairs(redis.call('HRANDFIELD', errors, 16)) do
    -- A field that is no entry id at all (any client can write one) goes too.
    local entry = redis.pcall('XPENDING', src, group, id, id, 1)
    local gone = entry.err ~= nil
    if not gone and entry[1] == nil then
      delivered = delivered or last_delivered()
      gone = not after(id, delivered) or #redis.call('XRANGE', src, id, id) == 0
    end
    if gone then redis.call('HDEL', errors, id) end
  end
end

-- The acknowledgements and the counters are written once per call, for everything moved, also when a command
-- failed half way through (an out-of-memory XADD, say): the moves before the failure stand, since scripts are
-- not rolled back.
-- Hand-overs of entries no longer pending (their owner acknowledged them): a few per call.
local function prune_handovers()
  if not has_handovers then return end
  for _, id in ipairs(redis.call('HRANDFIELD', handovers, 16)) do
    local entry = redis.pcall('XPENDING', src, group, id, id, 1)
    if entry.err ~= nil or entry[1] == nil then redis.call('HDEL', handovers, id) end
  end
end

-- Heartbeats of workers long gone (a Pod's name changes with every rollout): a few per call, those older than
-- HEARTBEAT_KEPT or ten minIdles, whichever is longer; a live worker writes its own again at its next tick.
local HEARTBEAT_KEPT = 3600000
local function prune_heartbeats()
  local kept = math.max(HEARTBEAT_KEPT, min_idle * 10)
  local sample = redis.call('HRANDFIELD', heartbeats, 16, 'WITHVALUES')
  for i = 1, #sample, 2 do
    local beat = tonumber(sample[i + 1])
    if not beat or tonumber(now_ms) - beat > kept then redis.call('HDEL', heartbeats, sample[i]) end
  end
end

local ok, failure = pcall(move_page)
if ok then ok, failure = pcall(prune_errors) end
if ok then ok, failure = pcall(prune_handovers) end
if ok then ok, failure = pcall(prune_heartbeats) end
if #acks > 2 then
  redis.call('XACK', unpack(acks))
  if has_handovers then redis.call('HDEL', handovers, unpack(acks, 3)) end
end
local function count(key, field, n)
  if n > 0 then redis.call('HINCRBY', key, field, n) end
end
count(terminal, 'PayloadDeleted', payload_deleted)
count(totals, 'payloadDeleted', payload_deleted)
count(terminal, 'MaxDeliveriesExceeded', dead_lettered - invalid_counts - fatal_counts)
count(terminal, 'InvalidDeliveryCount', invalid_counts)
count(terminal, 'NackedFatal', fatal_counts)
count(totals, 'deadLettered', dead_lettered)
count(totals, 'requeued', requeued)
count(totals, 'reassigned', reassigned)
count(totals, 'deadLetterEvicted', evicted)
if not ok then
  return redis.error_reply(type(failure) == 'table' and failure.err or tostring(failure))
end
local reached_end = (scanned == #page and #page < limit) and 1 or 0
local reply = {requeued, reassigned, dead_lettered, payload_deleted, skipped, too_large, scanned, evicted, idle,
  position, reached_end}
local fates = {}
for i = pairs_from, #ARGV, 2 do fates[#fates + 1] = fate[i] or '-' end
reply[12] = table.concat(fates)
reply[13] = unlisted
reply[14] = moves
for _, v in ipairs(waiting) do reply[#reply + 1] = v end
return reply
