-- floor.lua: the least a call of a sliding log that reads the user's log and keeps a TTL costs, called with
-- the arguments of one decide.lua request (packed values, member, refusal, the log's key) by
-- scripts/bench-calls.sh: read the log (GET, as decide.lua does once for the duplicate check and every cap)
-- and record the send as decide.lua does: a new log written with its TTL (SET ... PX), an entry appended to
-- an existing one (APPEND) and the TTL refreshed when it has fallen below the retention (PTTL), with none of
-- the logic between. decide.lua less this is what its logic costs. Not used by capper.
local now, _, retention = struct.unpack('>i8Bi8', ARGV[1])
local log = redis.call('GET', KEYS[1]) or ''
local item = struct.pack('>i8I2', now, #ARGV[2]) .. ARGV[2]
if log == '' then
  redis.call('SET', KEYS[1], item, 'PX', retention + 3600000)
else
  redis.call('APPEND', KEYS[1], item)
  if redis.call('PTTL', KEYS[1]) < retention then
    redis.call('PEXPIRE', KEYS[1], retention + 3600000)
  end
end
return {1, 0, #log}
