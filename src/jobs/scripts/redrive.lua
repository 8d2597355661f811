-- Redrive one batch of dead letters and record the progress, in one script.
--
-- KEYS[1] dead-letter stream    KEYS[2] the redrive's progress hash    KEYS[3] the stream's redrive lock
-- KEYS[4..] target streams of this batch
-- ARGV[1] the redrive's uid     ARGV[2] its name (written as `pelican-redrive` on each moved entry)
-- ARGV[3] the last dead-letter id this batch covers (the next batch starts after it)
-- ARGV[4] entries of the batch's range the caller left in place (outside the filter, too large)
-- ARGV[5] '1' when this batch ends the redrive (its lock is released with the record of its end), else '0'
-- ARGV[6] most fields an entry may have to be moved
-- ARGV[7..] triples: a dead-letter id, the index in KEYS of the stream it goes to, and how many entries of the range
--           before it (after the previous triple's id) the caller left in place
--
-- Returns {moved, missing, tooLarge}. When a move fails (an out-of-memory XADD, a target whose last id is the
-- largest possible), the moves before it are recorded as if the batch had ended just before the failing id, and
-- the failure is returned as an error: the next call starts at that id again.
--
-- Invariant: every id ends either moved (one entry in its target: the application's fields, the `pelican-*`
-- metadata stripped, then `pelican-redriven-from` <id> and `pelican-redrive` <name>; the dead letter deleted) or
-- still in the dead-letter stream, never both and never neither, and the progress hash moves with the entries in
-- the same call, also when the call fails half way, so a caller that dies at any instant resumes after exactly
-- what was done. Key types and the owner of the progress hash are checked before the first write; each copy is
-- written before the XDEL of its original.
local dlq, progress, lock = KEYS[1], KEYS[2], KEYS[3]
local uid, name, last_id, left, finished = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local max_fields = tonumber(ARGV[6])

local function expect_type(key, wanted)
  local t = redis.call('TYPE', key)['ok']
  if t ~= 'none' and t ~= wanted then
    return redis.error_reply('WRONGTYPE key ' .. key .. ' holds a ' .. t .. ', not a ' .. wanted)
  end
end
local bad = expect_type(dlq, 'stream') or expect_type(progress, 'hash')
if bad then return bad end
for i = 4, #KEYS do
  bad = expect_type(KEYS[i], 'stream')
  if bad then return bad end
end
local owner = redis.call('HGET', progress, 'uid')
if owner and owner ~= uid then
  return redis.error_reply('OWNED progress ' .. progress .. ' belongs to another redrive (uid ' .. owner .. ')')
end

-- The counts cannot fail after a move: a field that holds no integer (any client can write one) restarts at 0.
local counts = redis.call('HMGET', progress, 'moved', 'missing', 'skipped')
for i, field in ipairs({'moved', 'missing', 'skipped'}) do
  local v = counts[i]
  if v and (not string.match(v, '^%d+$') or #v > 17) then redis.call('HSET', progress, field, 0) end
end

local moved, missing, too_large = 0, 0, 0
-- The last id handled and the entries left in place up to it, for the record when a move fails.
local done_id, done_left = nil, 0
local function move_batch()
  for i = 7, #ARGV, 3 do
    local id, target = ARGV[i], KEYS[tonumber(ARGV[i + 1])]
    local entry = redis.call('XRANGE', dlq, id, id)[1]
    if entry == nil then
      missing = missing + 1
    elseif #entry[2] > max_fields then
      too_large = too_large + 1
    else
      local fields = entry[2]
      local args = {target, '*'}
      for f = 1, #fields, 2 do
        if string.sub(fields[f], 1, 8) ~= 'pelican-' then
          args[#args + 1] = fields[f]; args[#args + 1] = fields[f + 1]
        end
      end
      args[#args + 1] = 'pelican-redriven-from'; args[#args + 1] = id
      args[#args + 1] = 'pelican-redrive'; args[#args + 1] = name
      redis.call('XADD', unpack(args))
      redis.call('XDEL', dlq, id)
      moved = moved + 1
    end
    done_id, done_left = id, done_left + tonumber(ARGV[i + 2])
  end
end

local ok, failure = pcall(move_batch)
if ok then
  done_id, done_left = last_id, left
end
if done_id then
  redis.call('HSET', progress, 'uid', uid, 'lastId', done_id)
else
  redis.call('HSET', progress, 'uid', uid)
end
redis.call('HINCRBY', progress, 'moved', moved)
redis.call('HINCRBY', progress, 'missing', missing)
redis.call('HINCRBY', progress, 'skipped', done_left + too_large)
if not ok then
  return redis.error_reply(type(failure) == 'table' and failure.err or tostring(failure))
end
if finished == '1' then
  local now = redis.call('TIME')
  redis.call('HSET', progress, 'finishedAt', string.format('%d', tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)))
  if redis.call('HGET', lock, 'uid') == uid then redis.call('DEL', lock) end
end
return {moved, missing, too_large}
