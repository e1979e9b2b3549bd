-- decide.lua: check one send against a user's caps and, if every cap passes, record it.
-- Sliding log: one sorted set per user, score = send time (ms), member = job digest .. channel.
--
-- KEYS[1]  the user's log, e.g. fc:{123} (the hash tag keeps a user's keys in one slot)
-- ARGV[1]  now: ms since the epoch, from the worker's clock (never the server's)
-- ARGV[2]  member of this send: 8-byte digest of the job id followed by the channel
-- ARGV[3]  channel of this send
-- ARGV[4]  "1": record an allowed send, evict old entries, refresh the TTL (also on a duplicate);
--          "0": look only, write nothing
-- ARGV[5]  retention (ms), the longest window: entries this old are evicted, the key expires after it
-- ARGV[6..] three values per cap: window (ms), limit, channel ("" counts every channel)
--
-- An entry at time t is inside a window w at time now when now - w < t (it leaves exactly at t + w).
-- Reply: {status, cap, retry_at, count_1, ..., count_n}
--   status    1 allowed (recorded when ARGV[4] is "1"), 0 capped,
--             2 duplicate: this member is already in the log, i.e. the job was allowed before
--   cap       1-based index of the cap that decides retry_at; 0 unless capped
--   retry_at  ms at which every exceeded cap passes again; 0 unless capped, or never (a limit of 0)
--   count_i   sends in cap i's window before this decision (a channel cap counts its channel only)
local key = KEYS[1]
local now = tonumber(ARGV[1])
local member = ARGV[2]
local channel = ARGV[3]
local record = ARGV[4] == '1'
local retention = tonumber(ARGV[5])

if record then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - retention))
end

local status = 1
if redis.call('ZSCORE', key, member) then
  status = 2
end

local counts = {}
local hit, retry_at, never = 0, 0, false
local n = 0
for i = 6, #ARGV - 2, 3 do
  n = n + 1
  local window = tonumber(ARGV[i])
  local limit = tonumber(ARGV[i + 1])
  local cap_channel = ARGV[i + 2]
  local min = string.format('(%d', now - window)
  local count, at
  if cap_channel == '' then
    count = redis.call('ZCOUNT', key, min, '+inf')
    if count >= limit and limit > 0 then
      -- the (count - limit + 1)-th oldest entry in the window must leave it
      local e = redis.call('ZRANGEBYSCORE', key, min, '+inf', 'WITHSCORES', 'LIMIT', count - limit, 1)
      at = tonumber(e[2]) + window
    end
  else
    local entries = redis.call('ZRANGEBYSCORE', key, min, '+inf', 'WITHSCORES')
    local scores = {}
    count = 0
    for j = 1, #entries, 2 do
      if string.sub(entries[j], 9) == cap_channel then
        count = count + 1
        scores[count] = entries[j + 1]
      end
    end
    if count >= limit and limit > 0 then
      at = tonumber(scores[count - limit + 1]) + window
    end
  end
  counts[n] = count
  local applies = cap_channel == '' or cap_channel == channel
  if applies and status ~= 2 and count >= limit then
    status = 0
    if limit == 0 then
      if not never then hit = n end
      never = true
    elseif not never and at > retry_at then
      hit, retry_at = n, at
    end
  end
end
if never then
  retry_at = 0
end

if record and status ~= 0 then
  if status == 1 then
    redis.call('ZADD', key, now, member)
  end
  -- Also on a duplicate: the write advances this connection's replication offset
  -- past the earlier write of the same job, so a WAIT after the script waits for that too.
  redis.call('PEXPIRE', key, retention)
end

local reply = {status, hit, retry_at}
for i = 1, n do
  reply[3 + i] = counts[i]
end
return reply
