-- seed.lua: the seed's sliding log (Grab, ../shared/seeds), with the two windows of capper's benchmark caps,
-- for scripts/bench-calls.sh to measure what a call of that design costs Redis. Not used by capper.
-- For each window ZCOUNT its entries; when every count is under its limit ZADD the send; then
-- ZREMRANGEBYSCORE what is older than the eviction time.
-- KEYS[1] the user's log; ARGV[1] now (ms); ARGV[2] member; ARGV[3] eviction (ms); then per window: start, limit;
-- then, only when bench-calls measures the seed with a TTL on its key (its sorted sets never expire, which a
-- deployment must add), the TTL (ms), set by a PEXPIRE after the rest.
local now, last = ARGV[1], #ARGV
local ttl = nil
if last % 2 == 0 then
  ttl, last = ARGV[last], last - 1
end
local allowed = 1
for i = 4, last, 2 do
  if redis.call('ZCOUNT', KEYS[1], ARGV[i], now) >= tonumber(ARGV[i + 1]) then
    allowed = 0
    break
  end
end
if allowed == 1 then
  redis.call('ZADD', KEYS[1], now, ARGV[2])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[3])
if ttl then
  redis.call('PEXPIRE', KEYS[1], ttl)
end
return allowed
