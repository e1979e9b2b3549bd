-- floor.lua: the least a call of a sliding log that reads the user's log and keeps a TTL costs, called with
-- the arguments of one decide.lua request (packed values, member, refusal, the log's key) by
-- scripts/bench-calls.sh: read the log (ZRANGE WITHSCORES, as decide.lua does once for the duplicate check and
-- every cap), append the send (ZADD) and set the key's TTL (PEXPIRE, as decide.lua does on a key's first
-- write), with none of the logic between. decide.lua less this is what its logic costs. Not used by capper.
local now, _, retention = struct.unpack('>i8Bi8', ARGV[1])
local raw = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
redis.call('ZADD', KEYS[1], now, ARGV[2])
redis.call('PEXPIRE', KEYS[1], retention)
return {1, 0, #raw}
