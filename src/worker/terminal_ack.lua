-- End a message as terminal (SPEC section 4): acknowledge it and count its reason, once.
--
-- KEYS[1] source stream    KEYS[2] {T}:pelican:<group>:terminal
-- ARGV[1] group            ARGV[2] entry id    ARGV[3] reason code
--
-- Returns 1 when this call acknowledged the entry (and counted it), 0 when it was no longer pending.
-- Invariant: the counter moves only with the XACK that removed the entry, so a repeated ACK never counts twice.
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
