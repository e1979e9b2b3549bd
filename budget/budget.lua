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
-- ARGV[7]  burst (0: none, the whole limit may go at once; spread: false): otherwise the budget is spread
--          over its window by a token bucket inside the window's limit, kept in KEYS[2]. Tokens accrue at
--          limit/window, the limit's pace, up to burst (a fifth of the limit); an idle budget starts with the
--          whole limit; a call grants at most what has accrued. While the window is full nothing accrues, and
--          accrual resumes so that, when its oldest counted bucket leaves, that bucket's tokens up to a
--          bucket's share may be taken at once. Tokens freed in a lump come back at the pace, so lumps
--          dissolve into an even flow. A faster pace (twice the limit's was tried) keeps a lump whole: it
--          comes back a window, a bucket and the wait for the next decision later, so it drifts across the
--          windows' edges, and a window it straddles gets 92% of the limit once in about 30 windows.
--          Without a burst, tokens taken together are freed together a window and a bucket later and taken
--          together again: the same drifting lumps, and a window in 100 (one per bucket) can get none.
-- KEYS[2]  (with a burst) the rate's state, e.g. fc:b:{sms}:r (same slot): l = tokens accrued (a float),
--          t = ms they were counted at (after a full window, in the future)
-- Reply: {granted, used, bucket, next, b_1, n_1, b_2, n_2, ...}
--   granted  tokens taken now (0 when giving back or looking)
--   used     tokens counted in the window after this call
--   bucket   the bucket the granted tokens are counted in: they must be used before bucket + width
--   next     ms at which tokens come back: when the next token accrues when only the rate refused some,
--            else when the oldest counted bucket leaves the window; 0 when none
--   b_i n_i  every counted bucket and its tokens after this call: bucket b_i's n_i tokens come back at
--            b_i + width + window (the caller schedules refused jobs at those times)
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local width = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local delta = tonumber(ARGV[5])
local burst = tonumber(ARGV[7] or '0')
local rate = limit / window -- tokens per ms: the limit's pace
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

-- The rate's level, accrued up to now (none while a full window's oldest bucket has not left: t > now).
local level, at = 0, now
if burst > 0 and delta ~= 0 then
  local r = redis.call('HGETALL', KEYS[2])
  level, at = limit, now -- idle (the key expired): the whole limit, as without a burst
  for i = 1, #r, 2 do
    if r[i] == 'l' then
      level = tonumber(r[i + 1])
    elseif r[i] == 't' then
      at = tonumber(r[i + 1])
    end
  end
  if now > at then
    level, at = math.min(burst, level + (now - at) * rate), now
  end
  if delta < 0 then
    level = math.min(burst, level - delta)
  end
end

local granted = 0
if delta > 0 then
  granted = math.max(0, math.min(delta, limit - used))
  if burst > 0 then
    granted = math.min(granted, math.floor(level + 1e-9))
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
if oldest then
  next = oldest + width + window
end
if burst > 0 and delta ~= 0 then
  level = level - granted
  if used >= limit and oldest then -- full: nothing accrues until the oldest bucket leaves; then the tokens it
    -- frees may be taken at once up to a bucket's share (a lump beyond that comes back at the rate)
    local share = math.min(counted[oldest], math.ceil(limit * width / window))
    level, at = 0, oldest + width + window - share / rate
  elseif delta > 0 and granted < delta then -- the rate refused some: the next token
    next = at + math.ceil((1 - level) / rate)
  end
  redis.call('HSET', KEYS[2], 'l', string.format('%.6f', level), 't', string.format('%d', at))
  redis.call('PEXPIRE', KEYS[2], window + width)
end
local reply = {granted, used, cur, next}
for b, n in pairs(counted) do
  reply[#reply + 1] = b
  reply[#reply + 1] = n
end
return reply
