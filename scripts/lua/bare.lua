-- bare.lua: a script that only returns, called with decide.lua's arguments by scripts/bench-calls.sh: the cost
-- of an EVALSHA call itself (parsing, the arguments, the Lua call, the reply). Not used by capper.
return 1
