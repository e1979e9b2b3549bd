-- floor.lua: the least a call of a sliding log that reads the user's log and keeps a TTL costs, called with
-- the arguments of one decide.lua request (packed values, member, refusal, the log's key) by
-- scripts/bench-calls.sh: read the log (GET, as decide.lua does once for the duplicate check and every cap)
-- and record the send as decide.lua does: appended (APPEND) while the TTL its header says covers the
-- retention, else the log written whole with a new TTL (SET ... PX), with none of the logic between.
-- decide.lua less this is what its logic costs. Not used by capper.
local now, _, retention = struct.unpack('>i8Bi8', ARGV[1])
local log = redis.call('GET', KEYS[1]) or ''
local item = struct.pack('>i8I2', now, #ARGV[2]) .. ARGV[2]
if #log >= 8 and struct.unpack('>i8', log, 1) - now >= retention then
  redis.call('APPEND', KEYS[1], item)
else
  local ttl = retention + 3600000
  redis.call('SET', KEYS[1], struct.pack('>i8', now + ttl) .. string.sub(log, 9) .. item, 'PX', ttl)
end
return {1, 0, #log}
