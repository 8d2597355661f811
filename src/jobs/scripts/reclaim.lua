-- Reclaim / dead-letter one batch of PEL entries.
--
-- KEYS[1] source stream    KEYS[2] dead-letter stream    KEYS[3] totals hash    KEYS[4] terminal hash
-- KEYS[5] errors hash: entry id -> the text of its last failure, written by workers
-- ARGV[1] group            ARGV[2] min idle (ms)         ARGV[3] max deliveries
-- ARGV[4] strategy: Requeue | Reassign | DeadLetterOnly  ARGV[5] dead-letter MAXLEN (0: no cap)
-- ARGV[6] the operator's consumer name                   ARGV[7] most fields an entry may have to be moved
-- ARGV[8] byte budget: after copying this many bytes the script stops and leaves the remaining ids to the next call
-- ARGV[9] backoff factor   ARGV[10] backoff max (ms; 0: no backoff)   ARGV[11] most bytes of an error text kept
-- ARGV[12..] entry ids found idle by the caller's scan
--
-- Returns {requeued, reassigned, deadLettered, payloadDeleted, skipped, tooLarge, handled, deadLetterEvicted,
-- id, earlier, id, earlier, ...}: `handled` ids from ARGV[12] on were looked at (at least one); the caller sends
-- the rest again. The pairs name the requeued copies found not due yet and the deliveries each carries from before
-- it was requeued, so that the caller's scan can leave them alone until they are due.
--
-- Backoff: an entry is taken once idle min(max, minIdle * factor^(n-1)), n counting every delivery of the message
-- (a requeued copy's `pelican-deliveries` plus its own count); the caller's scan only knows the entry's own count,
-- so it sends entries that may be due and the exact check is here. An entry not due is skipped, never waited for.
-- The last error follows the message: to the requeued copy's new id, or into the dead letter as `pelican-last-error`
-- (cut to ARGV[11] bytes); its field goes when the entry leaves the PEL here, and a few fields of entries no longer
-- pending (ACKed by a client that left its field) are removed per call, so the hash shrinks back to the PEL.
--
-- Invariant: every id ends as exactly one of: untouched and still pending; requeued (one copy at the tail, the
-- original acknowledged); claimed by a live consumer; dead-lettered (one entry, the original acknowledged); or
-- dropped from the PEL because its payload is gone. Scripts are not rolled back on error, so every key type and the
-- group are checked before the first write, and each copy is written before the XACK that retires the original.
-- Pending state, idle time and delivery count are re-read here: a consumer that ACKed or re-read an entry since
-- the scan wins. Counting cannot fail after a move (counter fields that hold no integer are reset before the first
-- move, instead of making an HINCRBY raise an error half way through the batch). The byte budget keeps
-- one call short, so other clients of the server never see BUSY because of a batch of large entries.
-- Reassign hands an entry over with its delivery count raised by one (RETRYCOUNT), so the retry cap holds even
-- when the new owner never re-reads its PEL.

local src, dlq, totals, terminal, errors = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local group = ARGV[1]
local min_idle = tonumber(ARGV[2])
local max_deliveries = tonumber(ARGV[3])
local strategy = ARGV[4]
local dlq_maxlen = tonumber(ARGV[5])
local operator = ARGV[6]
local max_fields = tonumber(ARGV[7])
local byte_budget = tonumber(ARGV[8])
local factor, max_wait, error_max = tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])

local function expect_type(key, wanted)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= wanted then
    return redis.error_reply('WRONGTYPE key ' .. key .. ' holds a ' .. t .. ', not a ' .. wanted)
  end
end
local bad = expect_type(src, 'stream') or expect_type(dlq, 'stream')
  or expect_type(totals, 'hash') or expect_type(terminal, 'hash') or expect_type(errors, 'hash')
if bad then return bad end
-- Raises NOGROUP before any write when the group is gone.
redis.call('XPENDING', src, group)

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
sanitize(terminal, {'MaxDeliveriesExceeded', 'PayloadDeleted'})

local requeued, reassigned, dead_lettered, payload_deleted, skipped, too_large = 0, 0, 0, 0, 0, 0
local handled, evicted, copied = 0, 0, 0
local waiting = {}

-- Live consumers and their PEL sizes, read once per batch, for Reassign.
local live
local function least_loaded(except)
  if not live then
    live = {}
    for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', src, group)) do
      local info = {}
      for i = 1, #c, 2 do info[c[i]] = c[i + 1] end
      if info['name'] ~= operator and tonumber(info['idle']) < min_idle then
        live[#live + 1] = {name = info['name'], pending = tonumber(info['pending'])}
      end
    end
  end
  local best
  for _, c in ipairs(live) do
    if c.name ~= except and (best == nil or c.pending < best.pending) then best = c end
  end
  return best
end

-- The idle time an entry delivered n times must reach before it is taken.
local function threshold(n)
  if max_wait == 0 then return min_idle end
  local wait = min_idle
  for _ = 2, n do
    wait = wait * factor
    if wait >= max_wait then return math.max(max_wait, min_idle) end
  end
  return wait
end

-- Most streams have no errors hash (no worker records errors): then no entry costs a lookup.
local has_errors = redis.call('EXISTS', errors) == 1

-- The entry's last error, taken out of the hash (the caller puts it where the message goes).
local function take_error(id)
  if not has_errors then return nil end
  local text = redis.call('HGET', errors, id)
  if text then redis.call('HDEL', errors, id) end
  return text
end

-- Every move of the batch; the counters are written once, below.
local function move_batch()
for i = 12, #ARGV do
  if handled > 0 and copied >= byte_budget then break end
  handled = handled + 1
  local id = ARGV[i]
  local pending = redis.call('XPENDING', src, group, id, id, 1)[1]
  if pending == nil or tonumber(pending[3]) < min_idle then
    skipped = skipped + 1
  else
    local owner, deliveries = pending[2], tonumber(pending[4])
    local entry = redis.call('XRANGE', src, id, id)[1]
    if entry == nil then
      -- Deleted or trimmed while pending: a stale reference, not a message.
      redis.call('XACK', src, group, id)
      redis.call('HDEL', errors, id)
      payload_deleted = payload_deleted + 1
    else
      local fields = entry[2]
      local n = #fields
      -- A copy requeued earlier ends with Pelican's own two fields; the application's fields come before them.
      local origin, earlier = id, 0
      if n >= 4 and fields[n - 3] == 'pelican-origin-id' and fields[n - 1] == 'pelican-deliveries' then
        origin, earlier, n = fields[n - 2], tonumber(fields[n]) or 0, n - 4
      end
      local total = earlier + deliveries
      if n <= max_fields then
        for f = 1, n do copied = copied + #fields[f] end
      end
      if tonumber(pending[3]) < threshold(total) then
        -- Backoff: not due yet.
        skipped = skipped + 1
        if earlier > 0 then waiting[#waiting + 1] = id; waiting[#waiting + 1] = earlier end
      elseif n > max_fields then
        too_large = too_large + 1
      elseif total >= max_deliveries then
        local args = {dlq}
        if dlq_maxlen > 0 then
          -- The text of ARGV[5], not the Lua number, which large values would turn into 1e+15.
          args[#args + 1] = 'MAXLEN'; args[#args + 1] = '~'; args[#args + 1] = ARGV[5]
        end
        args[#args + 1] = '*'
        for f = 1, n do args[#args + 1] = fields[f] end
        local meta = {'pelican-source-stream', src, 'pelican-source-id', id, 'pelican-origin-id', origin,
          'pelican-group', group, 'pelican-consumer', owner, 'pelican-deliveries', string.format('%d', total),
          'pelican-reason', 'MaxDeliveriesExceeded', 'pelican-dead-lettered-at', now_ms}
        for _, v in ipairs(meta) do args[#args + 1] = v end
        local last_error = has_errors and redis.call('HGET', errors, id)
        if last_error then
          args[#args + 1] = 'pelican-last-error'; args[#args + 1] = string.sub(last_error, 1, error_max)
        end
        if dlq_maxlen > 0 then
          -- MAXLEN may drop older dead letters to make room: count them, they vanish from the one place people
          -- look for them.
          local before = redis.call('XLEN', dlq)
          redis.call('XADD', unpack(args))
          evicted = evicted + before + 1 - redis.call('XLEN', dlq)
        else
          redis.call('XADD', unpack(args))
        end
        redis.call('XACK', src, group, id)
        if last_error then redis.call('HDEL', errors, id) end
        dead_lettered = dead_lettered + 1
      elseif strategy == 'Requeue' then
        local args = {src, '*'}
        for f = 1, n do args[#args + 1] = fields[f] end
        args[#args + 1] = 'pelican-origin-id'; args[#args + 1] = origin
        args[#args + 1] = 'pelican-deliveries'; args[#args + 1] = string.format('%d', total)
        local copy = redis.call('XADD', unpack(args))
        redis.call('XACK', src, group, id)
        local last_error = take_error(id)
        if last_error then redis.call('HSET', errors, copy, last_error) end
        requeued = requeued + 1
      elseif strategy == 'Reassign' then
        local target = least_loaded(owner)
        if target then
          -- A hand-over is a delivery: without RETRYCOUNT, JUSTID leaves the count as it was, and an entry handed
          -- to consumers that never re-read their PEL would be reassigned forever, never reaching the cap.
          redis.call('XCLAIM', src, group, target.name, min_idle, id, 'RETRYCOUNT', deliveries + 1, 'JUSTID')
          target.pending = target.pending + 1
          reassigned = reassigned + 1
        else
          skipped = skipped + 1
        end
      else
        skipped = skipped + 1
      end
    end
  end
end

end

-- Fields of entries that left the PEL without Pelican (a client ACKed and left its field): a few per call.
local function prune_errors()
  if not has_errors then return end
  for _, id in ipairs(redis.call('HRANDFIELD', errors, 16)) do
    -- A field that is no entry id at all (any client can write one) goes too.
    local pending = redis.pcall('XPENDING', src, group, id, id, 1)
    if pending.err or pending[1] == nil then redis.call('HDEL', errors, id) end
  end
end

-- The counters move once per call, for everything moved, also when a command failed half way through the batch
-- (an out-of-memory XADD, say): the moves before the failure stand, since scripts are not rolled back.
local ok, failure = pcall(move_batch)
if ok then ok, failure = pcall(prune_errors) end
local function count(key, field, n)
  if n > 0 then redis.call('HINCRBY', key, field, n) end
end
count(terminal, 'PayloadDeleted', payload_deleted)
count(totals, 'payloadDeleted', payload_deleted)
count(terminal, 'MaxDeliveriesExceeded', dead_lettered)
count(totals, 'deadLettered', dead_lettered)
count(totals, 'requeued', requeued)
count(totals, 'reassigned', reassigned)
count(totals, 'deadLetterEvicted', evicted)
if not ok then
  return redis.error_reply(type(failure) == 'table' and failure.err or tostring(failure))
end
local reply = {requeued, reassigned, dead_lettered, payload_deleted, skipped, too_large, handled, evicted}
for _, v in ipairs(waiting) do reply[#reply + 1] = v end
return reply
