-- Reclaim / dead-letter one batch of PEL entries (SPEC section 3).
--
-- KEYS[1] source stream    KEYS[2] dead-letter stream    KEYS[3] totals hash    KEYS[4] terminal hash
-- ARGV[1] group            ARGV[2] min idle (ms)         ARGV[3] max deliveries
-- ARGV[4] strategy: Requeue | Reassign | DeadLetterOnly  ARGV[5] dead-letter MAXLEN (0: no cap)
-- ARGV[6] the operator's consumer name                   ARGV[7] most fields an entry may have to be moved
-- ARGV[8..] entry ids found idle by the caller's scan
--
-- Returns {requeued, reassigned, deadLettered, payloadDeleted, skipped, tooLarge}.
--
-- Invariant: every id ends as exactly one of: untouched and still pending; requeued (one copy at the tail, the
-- original acknowledged); claimed by a live consumer; dead-lettered (one entry, the original acknowledged); or
-- dropped from the PEL because its payload is gone. Scripts are not rolled back on error, so every key type and the
-- group are checked before the first write, and each copy is written before the XACK that retires the original.
-- Pending state, idle time and delivery count are re-read here: a consumer that ACKed or re-read an entry since
-- the scan wins.

local src, dlq, totals, terminal = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group = ARGV[1]
local min_idle = tonumber(ARGV[2])
local max_deliveries = tonumber(ARGV[3])
local strategy = ARGV[4]
local dlq_maxlen = tonumber(ARGV[5])
local operator = ARGV[6]
local max_fields = tonumber(ARGV[7])

local function expect_type(key, wanted)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= wanted then
    return redis.error_reply('WRONGTYPE key ' .. key .. ' holds a ' .. t .. ', not a ' .. wanted)
  end
end
local bad = expect_type(src, 'stream') or expect_type(dlq, 'stream')
  or expect_type(totals, 'hash') or expect_type(terminal, 'hash')
if bad then return bad end
-- Raises NOGROUP before any write when the group is gone.
redis.call('XPENDING', src, group)

local now = redis.call('TIME')
local now_ms = string.format('%d', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000))

local requeued, reassigned, dead_lettered, payload_deleted, skipped, too_large = 0, 0, 0, 0, 0, 0

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

for i = 8, #ARGV do
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
      redis.call('HINCRBY', terminal, 'PayloadDeleted', 1)
      redis.call('HINCRBY', totals, 'payloadDeleted', 1)
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
      if n > max_fields then
        too_large = too_large + 1
      elseif total >= max_deliveries then
        local args = {dlq}
        if dlq_maxlen > 0 then
          args[#args + 1] = 'MAXLEN'; args[#args + 1] = '~'; args[#args + 1] = dlq_maxlen
        end
        args[#args + 1] = '*'
        for f = 1, n do args[#args + 1] = fields[f] end
        local meta = {'pelican-source-stream', src, 'pelican-source-id', id, 'pelican-origin-id', origin,
          'pelican-group', group, 'pelican-consumer', owner, 'pelican-deliveries', string.format('%d', total),
          'pelican-reason', 'MaxDeliveriesExceeded', 'pelican-dead-lettered-at', now_ms}
        for _, v in ipairs(meta) do args[#args + 1] = v end
        redis.call('XADD', unpack(args))
        redis.call('XACK', src, group, id)
        redis.call('HINCRBY', terminal, 'MaxDeliveriesExceeded', 1)
        redis.call('HINCRBY', totals, 'deadLettered', 1)
        dead_lettered = dead_lettered + 1
      elseif strategy == 'Requeue' then
        local args = {src, '*'}
        for f = 1, n do args[#args + 1] = fields[f] end
        args[#args + 1] = 'pelican-origin-id'; args[#args + 1] = origin
        args[#args + 1] = 'pelican-deliveries'; args[#args + 1] = string.format('%d', total)
        redis.call('XADD', unpack(args))
        redis.call('XACK', src, group, id)
        redis.call('HINCRBY', totals, 'requeued', 1)
        requeued = requeued + 1
      elseif strategy == 'Reassign' then
        local target = least_loaded(owner)
        if target then
          -- JUSTID: the consumer's own re-read counts the delivery, so the claim must not count one too.
          redis.call('XCLAIM', src, group, target.name, min_idle, id, 'JUSTID')
          target.pending = target.pending + 1
          redis.call('HINCRBY', totals, 'reassigned', 1)
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

return {requeued, reassigned, dead_lettered, payload_deleted, skipped, too_large}
