-- forget.lua: remove a send from a user's log (its delivery failed: the user never received it).
-- KEYS[1]  the user's log
-- ARGV[1]  the 8-byte digest of the job id (the first 8 bytes of its member; see capping.Member)
-- Reply: how many entries were removed (0: the job is not in the log; 1 otherwise).
local raw = redis.call('ZRANGE', KEYS[1], 0, -1)
local n = 0
for i = 1, #raw do
  if string.sub(raw[i], 1, 8) == ARGV[1] then
    redis.call('ZREM', KEYS[1], raw[i])
    n = n + 1
  end
end
return n
