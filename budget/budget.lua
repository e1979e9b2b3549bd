-- budget.lua: a global send-rate budget as a bucketed rolling window (Istio's Redis quota algorithm): the
-- window is kept as a few time buckets, each a count, so a high limit costs a handful of counters, not one
-- log entry per send.
--
-- KEYS[1]  the budget's hash, e.g. fc:b:{sms}: field = a bucket's start (ms), value = tokens granted in it
-- ARGV[1]  now (ms since the epoch, from the worker's clock)
-- ARGV[2]  window (ms)
-- ARGV[3]  bucket width (ms); a bucket counts while its end is after now - window
-- ARGV[4]  limit: most tokens granted in any window
-- ARGV[5]  delta: > 0 take up to delta tokens (as many as the window has left); < 0 give -delta tokens back
--          to the bucket ARGV[6] (unused tokens of a lease, if that bucket still counts); 0 only look
-- ARGV[6]  the bucket to give tokens back to (ms), with delta < 0
-- ARGV[7]  a bucket's share of the limit (0: no bound, the default; spread: true in the rules): a bucket grants at most its share plus what the
--          8 buckets before it (a fifth of the window) left of theirs since the window's oldest counted bucket (a send promised a
--          bucket that arrives a few buckets late, as a held job does on a busy machine, still finds its
--          token; an idle budget carries nothing), so a budget is spread over its window
--          and delivers about its limit in every window under sustained demand; one whose whole limit goes
--          at once frees it at once a window and a bucket later, so its tokens come and go in lumps that
--          drift across windows (a window of 0 once in 40)
-- Reply: {granted, used, bucket, next, b_1, n_1, b_2, n_2, ...}
--   granted  tokens taken now (0 when giving back or looking)
--   used     tokens counted in the window after this call
--   bucket   the bucket the granted tokens are counted in: they must be used before bucket + width
--   next     ms at which tokens come back: the next bucket when only this bucket's bound refused some,
--            else when the oldest counted bucket leaves the window; 0 when none
--   b_i n_i  every counted bucket and its tokens after this call: bucket b_i's n_i tokens come back at
--            b_i + width + window (the caller schedules refused jobs at those times)
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local width = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local delta = tonumber(ARGV[5])
local per_bucket = tonumber(ARGV[7] or '0')
local cur = now - now % width

if delta < 0 then
  local b = ARGV[6]
  local n = tonumber(redis.call('HGET', key, b) or '0')
  if n > 0 then
    local back = math.min(n, -delta)
    if back == n then
      redis.call('HDEL', key, b)
    else
      redis.call('HINCRBY', key, b, -back)
    end
  end
end

local used, oldest, counted = 0, nil, {}
local h = redis.call('HGETALL', key)
for i = 1, #h, 2 do
  local b = tonumber(h[i])
  if b + width <= now - window then
    redis.call('HDEL', key, h[i])
  else
    used = used + tonumber(h[i + 1])
    counted[b] = tonumber(h[i + 1])
    if not oldest or b < oldest then
      oldest = b
    end
  end
end

local granted = 0
if delta > 0 then
  granted = math.max(0, math.min(delta, limit - used))
  if per_bucket > 0 then
    local bound = per_bucket
    for j = 1, 8 do -- since the oldest counted bucket: an idle budget carries nothing
      local b = cur - j * width
      if oldest and b >= oldest then
        bound = bound + math.max(0, per_bucket - (counted[b] or 0))
      end
    end
    granted = math.max(0, math.min(granted, bound - (counted[cur] or 0)))
  end
  if granted > 0 then
    redis.call('HINCRBY', key, string.format('%d', cur), granted)
    used = used + granted
    counted[cur] = (counted[cur] or 0) + granted
    if not oldest or cur < oldest then
      oldest = cur
    end
    redis.call('PEXPIRE', key, window + width)
  end
end

local next = 0
if delta > 0 and granted < delta and used < limit then -- this bucket's bound, not the window's limit
  next = cur + width
elseif oldest then
  next = oldest + width + window
end
local reply = {granted, used, cur, next}
for b, n in pairs(counted) do
  reply[#reply + 1] = b
  reply[#reply + 1] = n
end
return reply
