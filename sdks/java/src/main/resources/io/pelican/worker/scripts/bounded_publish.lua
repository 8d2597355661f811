-- Bounded publish: add an entry to a stream unless a bounded group's backlog is full.
--
-- KEYS[1] stream    KEYS[2] {T}:pelican:<stream>:bounds    KEYS[3] {T}:pelican:<stream>:rejected
-- ARGV    field1, value1, field2, value2, ...  (the entry, as for XADD)
--         or IDMP, producer id, message id, field1, value1, ...: an idempotent publish (Redis 8.6+, `XADD ... IDMP`):
--         the first publish of a (producer id, message id) pair within the stream's window adds the entry, every
--         later one returns the first one's id and writes nothing (the server counts it in `iids-duplicates`). The
--         odd number of arguments tells the two forms apart, so a field named IDMP is still a field.
--
-- Reply: the new entry id (an idempotent publish already made: the first entry's id). Refusal: the error `PELICAN_BACKLOG_FULL <group> <backlog> <max>`, nothing written but
-- one count under <group> in KEYS[3]. Any other error (a key of another type, an ACL that does not allow XINFO) is
-- the server's, with nothing written.
--
-- The bounds hash (field = group, value = maxLength) is kept by the operator from the policies. A group's backlog is
-- what it has not acknowledged: entries not yet delivered to it (lag, at most the stream's length: Redis 7.0
-- overstates it after a MAXLEN trim) plus its pending entries. When the server cannot tell the lag (XINFO GROUPS
-- reports none after an XDEL or a trim of entries past the group's position), every entry of the stream counts as
-- unread: an upper bound, so the bound still holds, and refusals may come early. The server tells the lag again
-- only once the group has read up to the stream's last entry; the operator's status counts the same way.
-- Invariant: an entry is added only when every bounded group's backlog is below its bound, so after the XADD no
-- backlog exceeds its bound. Groups named in KEYS[2] that the stream does not have bound nothing. The operator's
-- own writes (requeue copies) do not go through this script and are never refused. The check comes before the
-- duplicate check the XADD makes: a repeated idempotent publish may be refused while the bound is full (this call
-- wrote nothing; the first publish's entry is there, and the same key returns its id once there is room).
local idmp = #ARGV % 2 == 1 and ARGV[1] == 'IDMP'
local fields = idmp and 4 or 1
if #ARGV < fields + 1 or (#ARGV - fields + 1) % 2 ~= 0 then
  return redis.error_reply('ERR bounded publish needs field value pairs as arguments (after IDMP <producer> ' ..
    '<message> for an idempotent one), got ' .. #ARGV .. ' arguments')
end
local bounds = redis.call('HGETALL', KEYS[2])
if #bounds > 0 then
  -- A stream that does not exist has no group to bound: its `no such key` is the one error let through (any other,
  -- an ACL refusal or a key of another type, is the reply).
  local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
  if groups.err then
    if not string.find(groups.err, 'no such key', 1, true) then return groups end
    groups = {}
  end
  local length = nil
  for _, info in ipairs(groups) do
    -- name, consumers, pending, last-delivered-id, entries-read, lag: the layout of Redis 7.0 on and Valkey, read by
    -- position (a search by field name costs more than the check of two names).
    if info[5] ~= 'pending' or info[11] ~= 'lag' then
      return redis.error_reply('ERR bounded publish needs XINFO GROUPS as Redis 7.0 or later replies it')
    end
    local name, pending, lag = info[2], info[6], info[12]
    for i = 1, #bounds, 2 do
      if bounds[i] == name then
        -- A value that is no number bounds nothing (the operator puts the policy's back at its next look).
        local max = tonumber(bounds[i + 1]) or math.huge
        -- The stream's length is read only when it matters: the lag is unknown, or the backlog looks full and the
        -- lag may be overstated.
        if type(lag) ~= 'number' or lag + pending >= max then
          length = length or redis.call('XLEN', KEYS[1])
          if type(lag) ~= 'number' or lag > length then lag = length end
        end
        local backlog = lag + pending
        if backlog >= max then
          redis.call('HINCRBY', KEYS[3], name, 1)
          return redis.error_reply(string.format('PELICAN_BACKLOG_FULL %s %d %d', name, backlog, max))
        end
      end
    end
  end
end
if idmp then
  return redis.call('XADD', KEYS[1], 'IDMP', ARGV[2], ARGV[3], '*', unpack(ARGV, 4))
end
return redis.call('XADD', KEYS[1], '*', unpack(ARGV))
