-- Runs health.lua the way Argo CD does: `obj` is a global table, the script's return value is the health.
-- Usage: lua5.1 run_health.lua <health.lua> <fixture.lua>; prints "<status>\t<message>".
local fixture = assert(loadfile(arg[2]))
obj = fixture()
local health = assert(loadfile(arg[1]))()
print(health.status .. "\t" .. (health.message or ""))
