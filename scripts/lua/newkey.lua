-- newkey.lua: a user's log written whole with its TTL (SET ... PX) and nothing else, called with the arguments
-- of one decide.lua request by scripts/bench-calls.sh: what a first send costs any sliding log that lets its
-- keys expire, beside the seed's design (scripts/lua/seed.lua), whose sorted sets never expire. Not used by
-- capper.
local now, _, retention = struct.unpack('>i8Bi8', ARGV[1])
local ttl = retention + 3600000
redis.call('SET', KEYS[1], struct.pack('>i8i8I2', now + ttl, now, #ARGV[2]) .. ARGV[2], 'PX', ttl)
return {1, 0, 0}
