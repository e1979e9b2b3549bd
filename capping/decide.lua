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
-- ARGV[5..] four values per cap:
--   since    first ms that counts (rolling: now - window + 1; calendar: the period's start)
--   limit    most sends allowed in the window
--   reset    rolling: the window's length in ms (a send counts until score + window);
--            calendar: minus the period's end, when a capped send may go
--   filter   "" for every send and not shadow; else packed: 1 byte flags (1 = shadow: count and report,
--            never block), 1 byte n and n 2-byte channel digests, 1 byte m and m 2-byte tag digests,
--            then a 4-byte campaign digest or nothing
--
-- A cap applies to this send when the send's member matches its scope, and counts the entries that match.
-- Reply: {status, cap, retry_at, count_1, ..., count_n}
--   status    1 allowed (recorded when ARGV[3] is "1"), 0 capped,
--             2 duplicate: this member is already in the log, i.e. the job was allowed before
--   cap       1-based index of the cap that decides retry_at; 0 unless capped
--   retry_at  ms at which every exceeded cap passes again; 0 when capped for good (a limit of 0);
--             for a duplicate, the ms at which the job was recorded; for an allowed send, the ms it is
--             recorded at: now, or the log's latest entry if that is later (another worker's clock read
--             later but its script ran first), so a user's log is in the order its decisions were taken
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
local recorded = redis.call('ZSCORE', key, member)
if recorded then
  status = 2
end

-- parse unpacks a filter: shadow, channels, tags, campaign, and whether it selects at all.
local function parse(f)
  if f == '' then
    return false, '', '', '', false
  end
  local nc = string.byte(f, 2)
  local p = 3 + 2 * nc
  local channels = string.sub(f, 3, p - 1)
  local nt = string.byte(f, p)
  local tags = string.sub(f, p + 1, p + 2 * nt)
  local campaign = string.sub(f, p + 1 + 2 * nt)
  return string.byte(f, 1) % 2 == 1, channels, tags, campaign, channels ~= '' or tags ~= '' or campaign ~= ''
end

-- The entries a scoped cap looks at, fetched once from the earliest bound.
local caps = {}
local earliest
for i = 5, #ARGV - 3, 4 do
  local c = {since = tonumber(ARGV[i]), limit = tonumber(ARGV[i + 1]), reset = tonumber(ARGV[i + 2])}
  c.shadow, c.channels, c.tags, c.campaign, c.scoped = parse(ARGV[i + 3])
  if c.scoped and (not earliest or c.since < earliest) then
    earliest = c.since
  end
  caps[#caps + 1] = c
end
local entries
if earliest then
  entries = redis.call('ZRANGEBYSCORE', key, string.format('%d', earliest), '+inf', 'WITHSCORES')
end

local counts = {}
local hit, retry_at, never = 0, 0, false
for n, c in ipairs(caps) do
  local limit = c.limit
  local min = string.format('%d', c.since)
  local count, oldest
  if not c.scoped then
    count = redis.call('ZCOUNT', key, min, '+inf')
    if count >= limit and limit > 0 and c.reset > 0 then
      -- the (count - limit + 1)-th oldest entry in the window must leave it
      local e = redis.call('ZRANGEBYSCORE', key, min, '+inf', 'WITHSCORES', 'LIMIT', count - limit, 1)
      oldest = tonumber(e[2])
    end
  else
    local scores = {}
    count = 0
    for j = 1, #entries, 2 do
      local score = tonumber(entries[j + 1])
      if score >= c.since and matches(entries[j], c.channels, c.tags, c.campaign) then
        count = count + 1
        scores[count] = score
      end
    end
    if count >= limit and limit > 0 and c.reset > 0 then
      oldest = scores[count - limit + 1]
    end
  end
  counts[n] = count
  if not c.shadow and status ~= 2 and count >= limit and (not c.scoped or matches(member, c.channels, c.tags, c.campaign)) then
    status = 0
    local at = -c.reset
    if c.reset > 0 then
      at = (oldest or 0) + c.reset -- no oldest only with a limit of 0, which never passes
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
if status == 2 then
  retry_at = tonumber(recorded)
end

if status == 1 then
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] and tonumber(last[2]) > now then
    now = tonumber(last[2])
  end
  retry_at = now
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
for i = 1, #caps do
  reply[3 + i] = counts[i]
end
return reply
