-- Bounded publish of a batch: add entries to a stream, in order, as many as every bounded group's backlog has room
-- for, with one backlog check for the whole batch.
--
-- KEYS[1] stream    KEYS[2] {T}:pelican:<stream>:bounds    KEYS[3] {T}:pelican:<stream>:rejected
-- ARGV[1] how many entries, n
-- ARGV[2..] each entry in turn: how many arguments it has (2 per field), then its field1, value1, field2, value2, ...
--          An entry may start with IDMP, producer id, message id (3 more arguments, so an odd count): it is published
--          idempotently (Redis 8.6+, `XADD ... IDMP`), as in bounded_publish.lua: a message id the producer already
--          published within the stream's window writes nothing, and its id is the first entry's.
--
-- Reply: {ids, refusal}. `ids` are the ids of the entries added: the first k of the n, in order. `refusal` is empty
-- when k = n (an idempotent entry already published counts among the k, with the first entry's id, though it adds
-- nothing: the room is counted before the XADDs); otherwise it is {group, backlog, max} of the group with the least room, the last n - k entries were
-- not written, and n - k is counted under that group in KEYS[3]. Malformed arguments are an error reply, before
-- anything is written; so is any error of the check (a key of another type, an ACL that does not allow XINFO), and
-- an entry of more than 3,990 fields (what one Lua call can pass on). An error after the first XADD (the server out
-- of memory, say) is an error reply with the code PELICAN_PARTIAL: the first entries may have been written, so the
-- caller must treat the outcome as unknown.
--
-- The backlog is counted exactly as bounded_publish.lua counts it, with the same calls (lag plus pending; the whole
-- stream as unread when the server cannot tell the lag; the length read only when it matters). The room of the batch
-- is the least, over the bounded groups, of their bound minus their backlog.
-- Invariant: after the call no bounded group's backlog exceeds its bound, and an entry is written only when every
-- entry before it in the batch was. Every argument is checked before the first XADD, so a call that is refused for
-- its arguments writes nothing.
local n = tonumber(ARGV[1])
if not n or n < 1 or n ~= math.floor(n) then
  return redis.error_reply('ERR bounded publish batch needs the number of entries first, got ' .. tostring(ARGV[1]))
end
-- Where each entry's fields start and end in ARGV, and where its IDMP producer id stands (nil: none).
local first, last, idmp = {}, {}, {}
local at = 2
-- The most arguments unpack() hands to one call (Lua's C stack holds 8,000), less the XADD's own key and id.
local MAX_ARGS = 7980
for i = 1, n do
  local count = tonumber(ARGV[at])
  local key = count and count % 2 == 1 and ARGV[at + 1] == 'IDMP'
  local fields = key and count - 3 or count
  if not fields or fields < 2 or fields % 2 ~= 0 or at + count > #ARGV then
    return redis.error_reply('ERR bounded publish batch: entry ' .. i .. ' needs an even number of arguments ' ..
      '(field value pairs, after IDMP <producer> <message> for an idempotent one) after its count, got ' ..
      tostring(ARGV[at]))
  end
  if count > MAX_ARGS then
    return redis.error_reply('ERR bounded publish batch: entry ' .. i .. ' has ' .. (count / 2) .. ' fields, ' ..
      'more than the ' .. (MAX_ARGS / 2) .. ' one script call can add: nothing was written')
  end
  if key then idmp[i] = at + 2 end
  first[i], last[i] = at + 1 + count - fields, at + count
  at = at + count + 1
end
if at ~= #ARGV + 1 then
  return redis.error_reply('ERR bounded publish batch: ' .. (#ARGV + 1 - at) .. ' arguments after the last of ' .. n ..
    ' entries')
end

local room, full = n, nil
local bounds = redis.call('HGETALL', KEYS[2])
if #bounds > 0 then
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
  if groups.err then
    if not string.find(groups.err, 'no such key', 1, true) then return groups end
    groups = {}
  end
  local length = nil
  for _, info in ipairs(groups) do
    if info[5] ~= 'pending' or info[11] ~= 'lag' then
      return redis.error_reply('ERR bounded publish needs XINFO GROUPS as Redis 7.0 or later replies it')
    end
    local name, pending, lag = info[2], info[6], info[12]
    for i = 1, #bounds, 2 do
      if bounds[i] == name then
        -- A value that is no number bounds nothing (the operator puts the policy's back at its next look); one
        -- with a fraction bounds at its whole part, as the single publish compares it.
        local max = tonumber(bounds[i + 1])
        if max == nil or max ~= max then max = math.huge elseif max < math.huge then max = math.floor(max) end
        if type(lag) ~= 'number' or lag + pending + n > max then
          length = length or redis.call('XLEN', KEYS[1])
          if type(lag) ~= 'number' or lag > length then lag = length end
        end
        local backlog = lag + pending
        if max - backlog < room then
          room = math.max(0, max - backlog)
          full = {name, backlog, max}
        end
      end
    end
  end
end

local ids = {}
local ok, failure = pcall(function()
  for i = 1, room do
    if idmp[i] then
      ids[i] = redis.call('XADD', KEYS[1], 'IDMP', ARGV[idmp[i]], ARGV[idmp[i] + 1], '*', unpack(ARGV, first[i], last[i]))
    else
      ids[i] = redis.call('XADD', KEYS[1], '*', unpack(ARGV, first[i], last[i]))
    end
  end
end)
if not ok then
  local text = type(failure) == 'table' and failure.err or tostring(failure)
  if #ids == 0 then return redis.error_reply(text) end
  return redis.error_reply('PELICAN_PARTIAL ' .. #ids .. ' of ' .. n .. ' entries written before: ' .. text)
end
if room < n then
  redis.call('HINCRBY', KEYS[3], full[1], n - room)
  return {ids, full}
end
return {ids, {}}
