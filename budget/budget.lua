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
--          to the bucket ARGV[6] (unused tokens of a lease, if that bucket still counts; with wants, the
--          tokens of claims whose sends were not new: each want's promise is kept again); 0 only look
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
-- KEYS[3]  the promises, e.g. fc:b:{sms}:p (same slot): field = a bucket's start (ms), value = tokens promised
--          to refused jobs told to come back then and not claimed yet. Every replica's refusals are promised
--          here, so no token is promised twice, and a promised token is kept for its job: a send that is not
--          claiming one takes a token only if every promise due before the token comes back still has its
--          token (but for those due just before: `early`, below). A
--          promise not claimed within ARGV[8] ms of its time lapses (its job is late or not coming back). A
--          claim whose token is not back yet (the job that had it before came late) follows it: it is
--          promised the time the next counted token comes back (a spread budget's, the first bucket from
--          then with fewer promises than a bucket's share of the limit).
-- ARGV[8]  lapse (ms)
-- ARGV[9]  n: the wants of this call, each a triple from ARGV[10]: (promised, until, job); promised is the
--          time a refused job was told in ms (0: a new want), which claims a token promised then; until is the
--          last moment the job can come back in ms (0: no bound); job names the job ('': no name). Claims are
--          served first; a claim whose promise lapsed is a new want, ahead of the others. delta counts the new
--          wants and the lease beyond them. Minus a time not due yet: an early claim of that promise (a held job
--          released before it: a token was put back, or a promise given up, that no send was there to take),
--          served after the new wants as one of them would be, its own promise not counted against it; granted
--          (-1), its promise is given up for the next early claim; refused, it keeps it (told its time), or is
--          promised instead the next token back no one is promised, when that is sooner.
-- ARGV[10 + 3n] grace (ms; 0 when absent): how far behind the newest call's clock another call's may be and
--          still be counted right. A bucket is kept that long after it leaves the window: a call whose clock
--          reads earlier than one before it (a worker that read its clock and was then descheduled, or whose
--          clock runs behind) counts every bucket of its own window. Dropped at the newer call's window, the
--          oldest bucket was missing from the older call's, which granted its tokens again: 1,010 in a window of 1,000
--          (TestAStaleClockKeepsTheBound), and with every core busy 55 SMS in a second of 50 by decision time.
-- ARGV[11 + 3n] spare (1, with delta < 0 and no wants): the tokens given back were taken by sends that were then
--          capped (Budgets.PutBack). For `early` buckets they are spare (sp, st in KEYS[2]: how many, until
--          when): new wants may take them whatever the promises after them count on, in the capped send's place
--          (a token so taken comes back a little after that send's would have; the claim promised it next
--          follows it), and claims take no more room than they had without them. With every token promised, a
--          token back at a random moment was otherwise owed to the promises due in the next few hundred
--          milliseconds (free, below) or taken by a claim whose own token was not back yet (and then went
--          unclaimed in turn): a new send took one in three of them, on a fixed clock.
-- KEYS[4]  (with named wants) the promises by job, e.g. fc:b:{sms}:j (same slot): a sorted set, member = a
--          job's name, score = the time it was promised. A promise is the job's, not its copy's: a copy of a
--          held job decided again (its input redelivered after a rebalance, before its offset was committed)
--          is told the time its job was promised, and promised nothing more; as a new want, it claims its
--          job's token once that is due. Promised again, it took a token that came back to a duplicate and
--          waited for no one; refused, it was capped, and the held copy came back to be capped after it
--          ("refused before") while its token waited for no one.
-- KEYS[5]  (with named wants) the jobs whose token was claimed, e.g. fc:b:{sms}:c: member = a job's name,
--          score = when, kept for a window and the lapse. Another copy that asks (a claim or a new want) is
--          answered -2 and takes no token: the caller checks it as a duplicate of the copy that took it.
-- Reply: {extra, used, bucket, next, r_1, ..., r_n}
--   extra    tokens taken beyond the wants (a lease: the caller's reserve)
--   used     tokens counted in the window after this call
--   bucket   the bucket the taken tokens are counted in: they must be used before bucket + width
--   next     ms at which tokens come back: when the next token accrues when only the rate refused some,
--            else when the oldest counted bucket leaves the window; 0 when none
--   r_i      want i: 0 granted, -1 granted the token promised to it (a claim), -2 its job's token went to another
--            copy of it; else the ms at which it may come back: the start of the earliest bucket with a token no
--            one was promised, which is promised to it if that is `early` buckets before its until (a claim that
--            follows its token: before its until), or its job's promise; minus that time when it is promised
--            nothing (it cannot wait for it)
local key = KEYS[1]
local now = tonumber(ARGV[1])
local window = tonumber(ARGV[2])
local width = tonumber(ARGV[3])
local limit = tonumber(ARGV[4])
local delta = tonumber(ARGV[5])
local burst = tonumber(ARGV[7] or '0')
local lapse = tonumber(ARGV[8] or '0')
local n = tonumber(ARGV[9] or '0')
local grace = tonumber(ARGV[10 + 3 * n] or '0')
local spareBack = ARGV[11 + 3 * n] == '1'
local rate = limit / window -- tokens per ms: the limit's pace
local cur = now - now % width
local buckets = window / width
local horizon = 64 * buckets -- buckets ahead a promise may be
-- A token is not kept idle for a promise due less than `early` buckets before it would come back if taken (a
-- tenth of a second's worth, at most a tenth of the window): taken now by a new want, or promised to a refused
-- one, it breaks that promise by at most that long (its claim follows the token, waiting in its tier's worker).
-- Kept, it could wait a whole round: a batch of claims a few buckets late (a busy replica's) brings its tokens
-- back after the round's last promises, which the tokens before them served, and those tokens were then kept
-- for the next round's last promises while new sends waited: 1 to 3% of the limit lost for each such batch, up
-- to 20% in a window (TestLateBatchesLeaveNoTokenIdle; TestThreeReplicasShareABudget with every core busy
-- granted fewer than 10,000 tokens in 16 runs of 40, 8,300 at least; 10,000 in 20 of 20 with this). With
-- `early` for new wants alone, that test's claims missed more (one run in 12 failed it: 6,100 of 9,000 found).
local early = math.max(1, math.min(math.floor(buckets / 10), math.ceil(100 / width)))
-- A spread budget promises at most a bucket's share of its limit for any one bucket (0: no such bound).
local per = 0
if burst > 0 then
  per = math.ceil(limit / buckets)
end
local unclaim = delta < 0 and n > 0 -- claims given back
local P, U, G, E, named = {}, {}, {}, {}, false -- each want's promise, until, job name and whether it is early
for i = 1, n do
  P[i], U[i], G[i] = tonumber(ARGV[7 + 3 * i]), tonumber(ARGV[8 + 3 * i]), ARGV[9 + 3 * i]
  if P[i] < 0 then -- early (see ARGV[9]): a claim before its promise
    P[i], E[i] = -P[i], P[i] < -now
  end
  named = named or G[i] ~= ''
end

local given = 0 -- tokens given back to their bucket
if delta < 0 then
  local b = ARGV[6]
  local c = tonumber(redis.call('HGET', key, b) or '0')
  if c > 0 then
    local back = math.min(c, -delta)
    given = back
    if back == c then
      redis.call('HDEL', key, b)
    else
      redis.call('HINCRBY', key, b, -back)
    end
  end
end
-- Spare tokens (ARGV[11 + 3n]): new wants may take them until st (read by every call that gives them or has
-- wants).
local spare, spareUntil, spareChanged = 0, 0, false
local function readSpare() -- (HGET: the worker's Redis ACL grants it, not HMGET)
  local st = tonumber(redis.call('HGET', KEYS[2], 'st') or '0')
  if st > now then
    spare, spareUntil = tonumber(redis.call('HGET', KEYS[2], 'sp') or '0'), st
  end
end
if spareBack and given > 0 then
  readSpare()
  spare, spareUntil, spareChanged = spare + given, now + early * width, true
elseif n > 0 then -- the claims below leave them to new wants
  readSpare()
end

local used, oldest, counted = 0, nil, {}
local h = redis.call('HGETALL', key)
for i = 1, #h, 2 do
  local b = tonumber(h[i])
  if b + width <= now - window - grace then
    redis.call('HDEL', key, h[i])
  elseif b + width > now - window then
    used = used + tonumber(h[i + 1])
    counted[b] = tonumber(h[i + 1])
    if not oldest or b < oldest then
      oldest = b
    end
  end
end

local asking = delta > 0 or n > 0

-- The rate's level, accrued up to now (none while a full window's oldest bucket has not left: t > now).
local level, at = 0, now
if burst > 0 and delta ~= 0 or burst > 0 and n > 0 then
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
  if delta < 0 and not unclaim then -- (a claim did not spend the level)
    level = math.min(burst, level - delta)
  end
end

-- The promises not lapsed: promised[t] is the count promised for bucket t. A call that only claims (a tier's
-- released sends) reads the buckets it claims and follows, an HGET each at its first use; a call that needs
-- every promise (a new want's room, a refusal's promise: see readAll's callers) reads them whole. A budget
-- keeps a promise every few buckets up to its longest hold ahead (500 for 50 a second held up to 10 s), and
-- reading them all on every claim cost such a call 0.7 ms of Redis (BenchmarkAKillWithReleaseLag: 0.15 ms
-- since), which the tier's next claims and every other call of the node waited for.
local promised, changed, whole, reads = {}, {}, false, 0
local readAll
setmetatable(promised, {__index = function(tab, t)
  if not asking then
    return 0
  end
  if reads >= 128 then -- a long walk (a follower past dense promises): cheaper read whole (128: the least
    -- Redis per call of BenchmarkAKillWithReleaseLag's, against 32, 64 and 256)
    readAll()
    return rawget(tab, t)
  end
  local c = 0
  if t + lapse >= now then -- a lapsed promise is none (the whole read drops it)
    c, reads = tonumber(redis.call('HGET', KEYS[3], string.format('%d', t)) or '0'), reads + 1
  end
  rawset(tab, t, c)
  return c
end})
-- readAll reads every promise not lapsed into promised (the buckets this call read or changed are kept as it
-- has them) and drops the lapsed ones; pairs(promised) sees them all from then on.
function readAll()
  if whole then
    return
  end
  whole = true
  setmetatable(promised, nil)
  if not asking then
    return
  end
  local p = redis.call('HGETALL', KEYS[3])
  for i = 1, #p, 2 do
    local t = tonumber(p[i])
    if t + lapse < now then
      redis.call('HDEL', KEYS[3], p[i])
    elseif promised[t] == nil then
      promised[t] = tonumber(p[i + 1])
    end
  end
end

local function count(c)
  if c > 0 then
    counted[cur] = (counted[cur] or 0) + c
    used = used + c
    if not oldest or cur < oldest then
      oldest = cur
    end
  end
end

-- Claims first: a job that comes back at its promise takes the token kept for it.
local reply = {0, 0, cur, 0}
if unclaim then -- a claim's send was not a new one (a duplicate: the job was copied on the delay tiers and
  -- decided before): it took the token promised to another job at the same time, which is kept for it again
  for i = 1, n do
    local p = P[i]
    if p > 0 and p + lapse >= now then
      promised[p], changed[p] = (promised[p] or 0) + 1, true
    end
    reply[4 + i] = 0
  end
  n = 0
end
-- Named wants: a job whose token another copy claimed is answered -2; a new want of a job promised a token
-- is told that time, or claims it once it is due.
local byJob = {} -- the jobs' promises as they change (false: claimed, none now)
local skip = {}
-- (Neither key exists while the budget promises nothing: a budget that never binds looks up no job.)
local hasJ = named and n > 0 and not unclaim and redis.call('EXISTS', KEYS[4]) == 1
local hasC = named and n > 0 and not unclaim and redis.call('EXISTS', KEYS[5]) == 1
if hasJ then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', '(' .. string.format('%d', now - lapse))
end
if hasC then
  redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. string.format('%d', now - lapse - window))
end
if hasJ or hasC then
  for i = 1, n do
    local g = G[i]
    if g ~= '' then
      if hasC and redis.call('ZSCORE', KEYS[5], g) then
        reply[4 + i], skip[i] = -2, true
      elseif hasJ and P[i] == 0 then
        local t = tonumber(redis.call('ZSCORE', KEYS[4], g) or '0')
        if t > now then
          reply[4 + i], skip[i] = t, true
        elseif t > 0 then -- due: it claims it
          P[i] = t
        end
      end
    end
  end
end
local function promise(i, t) -- want i is promised t
  if G[i] ~= '' then
    byJob[G[i]] = t
  end
end
-- told answers want i for another copy of its job in this call (a delay tier's reader can hand one batch a
-- message twice, around its group's rejoin): -2 if that copy claimed the job's token, the time it was promised
-- (the copy is told it, promised nothing); false if none did. Without it each copy was promised a token, and
-- the one no copy claims waited for nobody until it lapsed.
local function told(i)
  if G[i] == '' then
    return false
  end
  local t = byJob[G[i]]
  if t == false then
    return -2
  end
  return t or false
end

-- follow returns when a token comes back for a claim whose token is not back yet: the first counted bucket,
-- oldest first, whose tokens back a window and a bucket after it are not all promised already, or, every
-- such token promised, the oldest's. Each follower takes one of them, so the claims of one call that find
-- their tokens taken (a rebalance's late claims) follow them one a token, not all to the oldest bucket's
-- return: 41 of them at one instant left the window before it 10 of 50 in a burst after a SIGKILL.
-- A spread budget's follower is promised the first bucket from that return with fewer promises than a
-- bucket's share (`per`), so the followers of one return are spread over the buckets after it. The sends due
-- during a rebalance claim together when the tiers resume, and their tokens come back together a window and a
-- bucket later: followers that all went to that return claimed them together again, so the lump came round
-- every round, drifting a bucket a round, and the window whose edge it crossed got the paced rest alone (8
-- to 44 of 50 in 7 runs of 37 of a burst with a SIGKILL; TestAStallLeavesNoLump: 49 at one instant a round).
-- Spread, they dissolve the lump in one round at the cost of a few buckets' wait for its tokens. With up to
-- two shares a bucket (a share beside the walk's; tried), the windows of a burst with a SIGKILL held at 48
-- of 50 in 4 runs of 9, where one share gives 49; kept further apart (the k-th k buckets' shares after the
-- return, counted across calls; tried), the tokens idled longer and the window after the grace got 68 to 88%
-- in 5 runs of 6.
local backs, nb = nil, 1 -- the counted buckets, oldest first (made at the first follower)
local function follow()
  if not backs then
    backs = {}
    for b in pairs(counted) do
      backs[#backs + 1] = b
    end
    table.sort(backs)
  end
  while nb <= #backs do
    local t = backs[nb] + width + window
    if (counted[backs[nb]] or 0) > (promised[t] or 0) then
      return t
    end
    nb = nb + 1
  end
  return oldest + width + window
end

local fresh = {} -- the wants without a token yet, in the order they are served: lapsed claims first
local claimed = 0
for i = 1, n do
  local p, u = P[i], U[i]
  local other = told(i) -- another copy in this call claimed its job's token, or followed it
  if other then
    reply[4 + i], skip[i] = other, true
  end
  if skip[i] or E[i] then -- answered, or early (after the new wants)
  elseif p > 0 and (promised[p] or 0) > 0 and used + claimed < limit - spare then
    promised[p] = promised[p] - 1
    changed[p] = true
    claimed = claimed + 1
    reply[4 + i] = -1
    if G[i] ~= '' and not unclaim then
      byJob[G[i]] = false
      redis.call('ZADD', KEYS[5], now, G[i])
    end
  elseif p > 0 and (promised[p] or 0) > 0 and oldest then -- its token is not back yet (the job that had it
    -- before came late): the promise follows it to when a token comes back for it
    local nf = follow()
    while per > 0 and (promised[nf] or 0) >= per do -- spread: a bucket's share a bucket, from the return on
      nf = nf + width
    end
    promised[p], changed[p] = promised[p] - 1, true
    reply[4 + i] = -nf
    if u == 0 or nf < u then -- (its promise kept the margin for this: see the walk)
      promised[nf], changed[nf] = (promised[nf] or 0) + 1, true
      promise(i, nf)
      reply[4 + i] = nf
    end
  elseif p > 0 then
    fresh[#fresh + 1] = i
  end
end
count(claimed)
local lapsedClaims = #fresh
for i = 1, n do
  if P[i] == 0 and not skip[i] then
    fresh[#fresh + 1] = i
  end
end
-- Early wants last: a token for one of them moves a held send earlier, one for a new want saves a hold. Each
-- gives its own promise up while the room is counted (the token kept for it is its own), and keeps it if
-- refused.
local walked = #fresh -- the wants promised a token when refused: the early ones keep theirs
local gaveUp = {}
for i = 1, n do
  if E[i] and not skip[i] then
    fresh[#fresh + 1] = i
    local p = P[i]
    if (promised[p] or 0) > 0 then
      promised[p], gaveUp[i] = promised[p] - 1, true
    end
  end
end

-- What a new want may take now: the room the window has, less the tokens every promise due before a token
-- taken now comes back (bucket + width + window, less `early` buckets) needs, with the tokens that leave the
-- window by then.
local function free()
  readAll()
  local back = cur + width + window - early * width
  local s, ev = limit - used, {}
  for b, c in pairs(counted) do
    if b + width + window < back then
      ev[#ev + 1] = {b + width + window, c}
    end
  end
  for t, c in pairs(promised) do
    if c > 0 then
      if t <= now then
        s = s - c
      elseif t < back then
        ev[#ev + 1] = {t, -c}
      end
    end
  end
  table.sort(ev, function(a, b)
    if a[1] ~= b[1] then
      return a[1] < b[1]
    end
    return a[2] < b[2]
  end)
  local least = s
  for _, e in ipairs(ev) do
    s = s + e[2]
    least = math.min(least, s)
  end
  return math.max(0, least)
end

local granted = 0
local ask = math.max(0, delta) + lapsedClaims + #fresh - walked
if ask > 0 then
  local room = free()
  if spare > 0 then -- a spare token is one a send that was capped took: a new send takes it in its place
    room = math.max(room, math.min(spare, limit - used))
  end
  granted = math.min(ask, room)
  if burst > 0 then -- the rate paces new wants; claims were paced when they were promised
    granted = math.min(granted, math.max(0, math.floor(level + 1e-9)))
  end
  count(granted)
end
if claimed + granted > 0 then
  redis.call('HINCRBY', key, string.format('%d', cur), claimed + granted)
  redis.call('PEXPIRE', key, window + width + grace)
end
if spare > 0 and granted > 0 then -- new sends took them
  spare, spareChanged = math.max(0, spare - granted), true
end
if spareChanged then
  if spare > 0 then
    redis.call('HSET', KEYS[2], 'sp', spare, 'st', string.format('%d', spareUntil))
    if redis.call('PTTL', KEYS[2]) < window + width then
      redis.call('PEXPIRE', KEYS[2], window + width)
    end
  else
    redis.call('HDEL', KEYS[2], 'sp', 'st')
  end
end
for k = 1, math.min(granted, #fresh) do
  local i = fresh[k]
  reply[4 + i] = 0
  if E[i] then -- its promise given up: claimed early
    reply[4 + i] = -1
    if gaveUp[i] then
      changed[P[i]] = true
    end
    if G[i] ~= '' then
      byJob[G[i]] = false
      redis.call('ZADD', KEYS[5], now, G[i])
    end
  elseif G[i] ~= '' and byJob[G[i]] == nil then -- a copy of its job later in this call is answered Copy (-2)
    byJob[G[i]] = false
  end
end
-- An early want refused keeps its promise, or trades it for the next token back that no one is promised, if that
-- is sooner: released at a promise given up whose token is not back yet (its previous holder came late), it
-- follows that token as the claim it replaces would have; otherwise the token went to no one.
for k = math.max(walked, granted) + 1, #fresh do
  local i = fresh[k]
  local p = P[i]
  if gaveUp[i] then
    promised[p] = promised[p] + 1
  end
  reply[4 + i] = p
  if oldest and promised[p] > 0 then
    local nf = follow()
    while per > 0 and (promised[nf] or 0) >= per do
      nf = nf + width
    end
    if nf > now and nf < p then
      promised[p], changed[p] = promised[p] - 1, true
      promised[nf], changed[nf] = (promised[nf] or 0) + 1, true
      promise(i, nf)
      reply[4 + i] = nf
    end
  end
end
reply[1] = math.max(0, granted - #fresh)

-- The refused wants are promised the starts of the earliest buckets after now's with a token no one else was
-- promised. The walk knows the tokens that come back: the room left, each counted bucket's tokens as it leaves
-- the window, and each promised token a window and two buckets after its time (claimed within a bucket);
-- less those promised. A token promised at a bucket is taken from then until it comes back, so a bucket may
-- promise only what every bucket until then can spare (the least pool over that span: a token that comes
-- back early must not go to a new want while a later promise counts on it, but for the last `early` buckets).
-- With a burst, promises keep the limit's pace: a bucket promises at most a bucket's share of the limit, and
-- below one a bucket, none within buckets/limit buckets of another. A want whose bucket is not `early` buckets
-- before its until is told it but promised nothing (it will not come back), and the next want is promised that
-- token. Those buckets are a claim's room to follow its token: one released a few tens of milliseconds late
-- (a tier's reader behind) takes a token a little late, and the claim promised that token next follows it past
-- its own promise. Promised up to its until, such a claim followed the token 10 and 30 ms past it and was
-- capped; its token then went to no one once new sends had stopped (every send left held, promised a later
-- token), and a window of a second got 47 of 50 (bench-budget, paced, at the end of the demand).
local j = granted + 1
if j <= walked then
  readAll()
  local first = cur + width
  -- Buckets after its own that a promised token comes back: a window and a bucket after it is claimed, within
  -- a bucket of its time (that bucket is the slack a late claim needs). One claimed later comes back later,
  -- and the claim promised it next follows it. The round is 2% longer than the window, so while every token
  -- goes to a held send, a window gets 98% of the limit when the promises keep the limit's pace. Promised a
  -- bucket's share each bucket (one, for 50 a second), the tokens went round in lumps (50 in half a window)
  -- that drifted two buckets a round, and a whole window that a lump straddled got 96%, at times 94%. A round
  -- of a window and a bucket (tried) lifted such windows to 98%, but left no slack: after a SIGKILL, 1.85 to
  -- 2.11 hold records per job (1.03 to 1.33 with it). Promises on a fixed grid of the limit's pace (bucket i
  -- of the window: floor((i + 1) * limit / buckets) - floor(i * limit / buckets), tried) spread the lumps,
  -- but a token back between the grid's slots waited for the next: 5 per second promised every 20th bucket,
  -- 18 buckets after the tokens came back. The pace here is relative: a promise keeps its distance from the
  -- promises around it, not from a grid.
  local ret = buckets + 2
  local net, K = {}, 0 -- by bucket index from first: tokens that come back, less those promised
  local function add(t, c)
    local k = math.max(0, math.ceil((t - first) / width))
    net[k] = (net[k] or 0) + c
    K = math.max(K, k + 1)
  end
  local pool = limit - used
  for b, c in pairs(counted) do
    add(b + width + window, c)
  end
  for t, c in pairs(promised) do
    if c > 0 and t <= now then -- due, not claimed yet: its token is taken, back as if promised now
      pool = pool - c
      add(first + (ret - 1) * width, c)
    elseif c > 0 then
      add(t, -c)
      add(t + ret * width, c)
    end
  end
  K = math.min(K, horizon)
  local pools = {}
  for k = 0, K - 1 do
    pool = pool + (net[k] or 0)
    pools[k] = pool
  end
  -- A token promised at bucket k is out of the pool from k until it comes back, ret buckets later: k may
  -- promise what every bucket of that span can spare (from K on, the pool stays). Not what every later bucket
  -- can: a promise broken further on (a token claimed late comes back late) would then stop every promise
  -- before it, and the refused sends, told the next bucket with none, came back to be held again each bucket.
  local least = {}
  local dq, head, tail = {}, 1, 0 -- a sliding minimum: bucket indexes whose pools increase from head to tail
  for k = K - 1, 0, -1 do
    while tail >= head and pools[dq[tail]] >= pools[k] do
      tail = tail - 1
    end
    tail = tail + 1
    dq[tail] = k
    while dq[head] > k + ret - 1 - early do
      head = head + 1
    end
    least[k] = pools[dq[head]]
  end
  -- Below a limit of one a bucket, a spread budget's promises keep the limit's pace: none less than `gap`
  -- buckets from another. `others` are the bucket indexes of the promises made before, in order; `o` the
  -- first of them not more than `gap` buckets behind the walk; `last` the walk's own last promise.
  local gap, others, o, last = 1, {}, 1, -horizon
  if per > 0 and limit < buckets then
    gap = math.floor(buckets / limit)
    for t, c in pairs(promised) do
      if c > 0 and t > first - gap * width then
        others[#others + 1] = (t - first) / width
      end
    end
    table.sort(others)
  end
  local function near(k) -- a promise at k would be less than gap buckets from another
    if gap == 1 then
      return false
    end
    while others[o] and others[o] <= k - gap do
      o = o + 1
    end
    return k - last < gap or (others[o] ~= nil and others[o] < k + gap)
  end
  local assigned, back = 0, {} -- new promises, and those coming back by bucket index
  for k = 0, horizon - 1 do
    if j > walked then
      break
    end
    assigned = assigned - (back[k] or 0)
    local t = first + k * width
    local p = promised[t] or 0
    local x = (least[k] or pool) - assigned
    if per > 0 then
      x = math.min(x, per - p)
    end
    if x > 0 and near(k) then
      x = 0
    end
    local took = 0
    while j <= walked and x > 0 do
      local i = fresh[j]
      local other = told(i)
      if other then
        reply[4 + i] = other
      else
        reply[4 + i] = -t
        local u = U[i]
        if u == 0 or t < u - early * width then
          took, x = took + 1, x - 1
          promise(i, t)
          reply[4 + i] = t
        end
      end
      j = j + 1
    end
    if took > 0 then
      last = k
      promised[t], changed[t] = p + took, true
      assigned = assigned + took
      back[k + ret] = (back[k + ret] or 0) + took
    end
  end
  for k = j, walked do -- no token in sight (nothing counted and no room: only after a failed call): told the
    -- next bucket, promised nothing
    reply[4 + fresh[k]] = first
  end
end
local promisedJob, claimedJob = false, false
for g, t in pairs(byJob) do
  if t then
    redis.call('ZADD', KEYS[4], t, g)
    promisedJob = true
  else
    claimedJob = true
    if hasJ then
      redis.call('ZREM', KEYS[4], g)
    end
  end
end
if promisedJob then -- kept as long as the promises and the claims they name
  redis.call('PEXPIRE', KEYS[4], 64 * window + lapse + width)
end
if claimedJob then
  redis.call('PEXPIRE', KEYS[5], window + lapse + width)
end
local wrote = false
for t in pairs(changed) do
  if promised[t] > 0 then
    redis.call('HSET', KEYS[3], string.format('%d', t), promised[t])
  else
    redis.call('HDEL', KEYS[3], string.format('%d', t))
  end
  wrote = true
end
if wrote then -- the promises live until the last of them lapses
  local last = 0
  for t in pairs(whole and promised or changed) do
    if promised[t] > 0 then
      last = math.max(last, t)
    end
  end
  local ttl = math.max(1, last - now) + lapse + width
  if whole and last > 0 then
    redis.call('PEXPIRE', KEYS[3], ttl)
  elseif last > 0 and redis.call('PTTL', KEYS[3]) < ttl then -- the other promises' TTL covers them already
    redis.call('PEXPIRE', KEYS[3], ttl)
  end
end

local next = 0
if oldest then
  next = oldest + width + window
end
if burst > 0 and (delta ~= 0 or n > 0) then
  level = level - granted
  if used >= limit and oldest then -- full: nothing accrues until the oldest bucket leaves; then the tokens it
    -- frees may be taken at once up to a bucket's share (a lump beyond that comes back at the rate)
    local share = math.min(counted[oldest], math.ceil(limit * width / window))
    level, at = 0, oldest + width + window - share / rate
  elseif ask > 0 and granted < ask then -- the rate refused some: the next token
    next = at + math.ceil((1 - level) / rate)
  end
  redis.call('HSET', KEYS[2], 'l', string.format('%.6f', math.max(0, level)), 't', string.format('%d', at))
  redis.call('PEXPIRE', KEYS[2], window + width)
end
reply[2], reply[4] = used, next
return reply
