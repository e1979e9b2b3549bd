-- decide.lua: check one send against a user's caps and, if every cap passes, record it.
-- Sliding log: one sorted set per user, score = send time (ms), member = the send's digests:
--   bytes 1-8 job id, 9-10 channel, 11-14 campaign, 15.. one pair per tag (see capping.Member).
--
-- KEYS[1]  the user's log, e.g. fc:{123} (the hash tag keeps a user's keys in one slot)
-- ARGV[1]  now: ms since the epoch, from the worker's clock (never the server's)
-- ARGV[2]  member of this send
-- ARGV[3]  "1": record an allowed send, evict old entries, refresh the TTL (also on a duplicate);
--          "0": look only, write nothing
-- ARGV[4]  retention (ms): entries this old are evicted, the key expires after it
-- ARGV[5..] eight values per cap:
--   since    first ms that counts (rolling: now - window + 1; calendar: the period's start)
--   limit    most sends allowed in the window
--   window   rolling: its length in ms (a send counts until score + window); calendar: 0
--   until    calendar: the period's end, when a capped send may go; rolling: 0
--   channels concatenated 2-byte channel digests; "" = any channel
--   tags     concatenated 2-byte tag digests; "" = any tags
--   campaign 4-byte campaign digest; "" = any campaign
--   shadow   "1": count and report, never block
--
-- A cap applies to this send when the send's member matches its scope, and counts the entries that match.
-- Reply: {status, cap, retry_at, count_1, ..., count_n}
--   status    1 allowed (recorded when ARGV[3] is "1"), 0 capped,
--             2 duplicate: this member is already in the log, i.e. the job was allowed before
--   cap       1-based index of the cap that decides retry_at; 0 unless capped
--   retry_at  ms at which every exceeded cap passes again; 0 unless capped, or never (a limit of 0)
--   count_i   entries of cap i's scope in its window before this decision
local key = KEYS[1]
local now = tonumber(ARGV[1])
local member = ARGV[2]
local record = ARGV[3] == '1'
local retention = tonumber(ARGV[4])

local function has(set, d)
  for i = 1, #set, #d do
    if string.sub(set, i, i + #d - 1) == d then
      return true
    end
  end
  return false
end

local function matches(m, channels, tags, campaign)
  if #m < 14 then
    return false
  end
  if channels ~= '' and not has(channels, string.sub(m, 9, 10)) then
    return false
  end
  if campaign ~= '' and string.sub(m, 11, 14) ~= campaign then
    return false
  end
  if tags ~= '' then
    for i = 15, #m - 1, 2 do
      if has(tags, string.sub(m, i, i + 1)) then
        return true
      end
    end
    return false
  end
  return true
end

if record then
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - retention))
end

local status = 1
if redis.call('ZSCORE', key, member) then
  status = 2
end

-- The entries a scoped cap looks at, fetched once from the earliest bound.
local entries
local earliest
for i = 5, #ARGV - 7, 8 do
  if ARGV[i + 4] ~= '' or ARGV[i + 5] ~= '' or ARGV[i + 6] ~= '' then
    local since = tonumber(ARGV[i])
    if not earliest or since < earliest then
      earliest = since
    end
  end
end
if earliest then
  entries = redis.call('ZRANGEBYSCORE', key, string.format('%d', earliest), '+inf', 'WITHSCORES')
end

local counts = {}
local hit, retry_at, never = 0, 0, false
local n = 0
for i = 5, #ARGV - 7, 8 do
  n = n + 1
  local since = tonumber(ARGV[i])
  local limit = tonumber(ARGV[i + 1])
  local window = tonumber(ARGV[i + 2])
  local until_ms = tonumber(ARGV[i + 3])
  local channels, tags, campaign = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6]
  local shadow = ARGV[i + 7] == '1'
  local min = string.format('%d', since)
  local count, oldest
  if channels == '' and tags == '' and campaign == '' then
    count = redis.call('ZCOUNT', key, min, '+inf')
    if count >= limit and limit > 0 and window > 0 then
      -- the (count - limit + 1)-th oldest entry in the window must leave it
      local e = redis.call('ZRANGEBYSCORE', key, min, '+inf', 'WITHSCORES', 'LIMIT', count - limit, 1)
      oldest = tonumber(e[2])
    end
  else
    local scores = {}
    count = 0
    for j = 1, #entries, 2 do
      local score = tonumber(entries[j + 1])
      if score >= since and matches(entries[j], channels, tags, campaign) then
        count = count + 1
        scores[count] = score
      end
    end
    if count >= limit and limit > 0 and window > 0 then
      oldest = scores[count - limit + 1]
    end
  end
  counts[n] = count
  if not shadow and status ~= 2 and count >= limit and matches(member, channels, tags, campaign) then
    status = 0
    local at = until_ms
    if window > 0 and oldest then
      at = oldest + window
    end
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
