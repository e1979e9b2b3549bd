#!lua flags=allow-cross-slot-keys
-- decide.lua: check sends against their users' caps and, for each send that every cap passes, record it.
-- Sliding log: one string per user: 8 bytes (i8) of the worker's ms until which the key's TTL was last set, then
-- the entries packed one after the other (struct: '>i8I2' then the member; a tally item '>BB' then the member):
--   score   i8, the send's time (ms); a mark of a refused send (see below) has minus the refusal's time and keep; a
--           tally item has instead one byte, tallyhead (1), where an entry's score starts with 0 and a mark's
--           with 255
--   member  its length (I2; a tally item's B), then the send's digests: bytes 1-8 job id, 9-10 channel, 11-14
--           campaign, 15.. one pair per tag (see capping.Member); a tally item's: its field (8 bytes: a digest
--           of a tally cap's scope and window), the sends counted (I4), until when it is kept (i8 ms), then
--           for a rolling cap the times of the last tallyTimes of them (i8 ms each, oldest first): 22 bytes
--           with its head for a count, at most 150 for a rolling cap's
-- marks and tally items first, then the entries oldest first, as a log written whole packs them (a patch, the
-- worker's (modePatch) or this script's (patchLog), appends new tally items after the entries: an item may lie
-- anywhere, and counts in no window). A tally cap (flagTally) is counted from its item, not the entries: a
-- lifetime count, or a long window's last sends, in a few bytes per scope; the log is kept until its last
-- item's keep (plus the retention's slack); past spillAt items, in the user's tally key (see spilledField), read
-- only by requests with a tally cap. A send that counts items is recorded by a patch (each item the log
-- holds written in place, the new ones appended with the entry), or with the log written whole (SET PX) when
-- an item changes its length (a rolling cap's times) or the log must be written whole anyway. A log costs a call one
-- GET, one struct.unpack per entry (no string made unless a step needs the members) and, when it records,
-- one APPEND of the entry (or one SET
-- PX of the whole log with a new TTL, once the TTL left is below the retention: the header says so without a
-- PTTL; every redis.call costs a script ~1.5 us); a sorted set cost ZRANGE WITHSCORES (two Lua strings and a
-- tonumber per entry), ZADD and PTTL. A log an older capper kept
-- as a sorted set (score, member; marks with negative scores) is read as such and written back as a string
-- by the first decision that records (see load).
--
-- A call carries one or more requests (the worker sends a batch's requests for one node in calls of up to
-- 32: a call's own cost, ~1.7 us, is paid once), decided in order (see the end). KEYS[1] is the first
-- request's log (it routes the call to its node); every request's keys are among its values in ARGV, so
-- that the requests of users of other slots of the node can share the call (allow-cross-slot-keys: Redis
-- refuses declared keys of several slots, not undeclared ones of the node's slots; a key of another node's
-- slot fails its request alone with "non local key", and the worker sends it again in a call of its own).
-- A request's values, in order (below, in the names of one request's call):
-- ARGV[2]  the request's values, packed big-endian (struct.unpack; one argument instead of 8 plus 4 per cap:
--          Redis parses every argument into an object and a Lua string, ~50 ns each, and tonumber on a
--          decimal costs as much again):
--   i8 now        ms since the epoch, from the worker's clock (never the server's)
--   B  mode       modeRecord (1): record an allowed send, evict old entries, refresh the TTL (also on a
--                 duplicate); modeMark (3): a send refused for good (expired, quiet hours, a budget, its caps' slot beyond
--                 its max_hold): unless it is in the log (a duplicate) or marked already, mark it refused as ARGV[3]
--                 names it; no caps: the header may be followed by the mark's keep (i8 ms, see readLog);
--                 modeExact (2): as modeRecord, at exactly now (a send made elsewhere, at its time), not after
--                 the log's latest; modeLook (0): look only, write nothing
--                 modeAppend (4): the worker decided the send allowed from its copy of the log, ARGV[3], which it holds
--                 to be the log whole (header and entries; no marks, none aged out, its TTL covering the
--                 retention, no entry after now): if the log is exactly that, and the user has no
--                 preferences when prefs is 1, the entry is appended (one GET, an EXISTS with prefs, one
--                 APPEND, reply replyWritten '=': what modeRecord would write and answer); otherwise the request is decided
--                 as in modeRecord (its caps are all there), so a copy gone stale costs nothing extra
--                 modePatch (6): as modeAppend, for a send with tally caps: ARGV[3] is the worker's copy, and
--                 its patch follows the prefs byte (I2 + bytes, before the caps): the header's new expiry (i8; 0:
--                 the TTL stays), the number of items counted in place (B), each as its member's place in the
--                 log (I4, 0-based) and its new member (I2 + bytes, of the same length), then the new tally
--                 items packed as the log packs them. If the log is the copy (and the user has no preferences
--                 when prefs is 1), each item is written in place (SETRANGE), the new items and the entry
--                 appended after the entries (one APPEND), and with an expiry the header and the TTL set
--                 (SETRANGE, PEXPIRE): counted as modeRecord counts, without the log written whole; reply '='.
--                 Otherwise decided as in modeRecord
--                 modeSpilled (7): as modeAppend, for a send with tally caps of a user whose tally is in the
--                 tally key (see spilledField), which the worker's copy lacks: it decided the send's other caps
--                 from the copy, ARGV[3]. If the log is that copy (no preferences when prefs is 1) and its header
--                 covers the retention, each tally cap is counted from the tally key; when none refuses the send
--                 or would give it an arbitrated last slot, the send is recorded as modeRecord records it (the
--                 tally key's items counted, the entry appended; the spill item's keep raised with the header
--                 when the send's keep passes it), reply replyWritten, then a byte (1: the spill item was raised,
--                 the log is not the copy and the entry), then the tally caps' counts (I4 each, in the caps'
--                 order). Otherwise decided as in modeRecord, nothing written first
--                 modeNewLog (5): the worker found the send allowed by every cap if the user has no log, a send that
--                 reads preferences (the others are written by a SET NX, no script): if the user has no
--                 log, and no preferences, ARGV[3] is written as the new log (its header, then the entry:
--                 what modeRecord would write; its TTL from the header's expiry), reply '='; otherwise the
--                 request is decided as in modeRecord
--   i8 retention  ms: entries this old are evicted, the key expires at least this long after a write
--   I2 maxlog     most log entries and tally items to return (0: never) when, after this decision, a cap that blocks is
--                 full (its count has reached its limit): the caller's near cache keeps that copy of the log
--   i8 window     arbitration window (ms), 0: none; with a window, KEYS[2] is the user's candidates
--   B  priority   the send's (0..100), which wins an arbitration
--   B  prefs      1: read the user's preferences (the last of KEYS); 0: the user has none to read
--   then per cap, to the end:
--   i8 since      first ms that counts (rolling: now - window + 1; calendar: the period's start)
--   i4 limit      most sends allowed in the window
--   i8 reset      rolling: the window's length in ms (a send counts until score + window);
--                 calendar: minus the period's end, when a capped send may go
--   B  flags      flagShadow (1): count and report, never block; flagArbitrated (2): its last slot goes to the
--                 highest priority of an arbitration window; flagApplies (4): the worker found the send in the
--                 cap's scope (Decide sends only the caps that apply), so the script need not check;
--                 flagTally (8): counted in the log's tally item of the field that follows the scope, not its
--                 entries (since 0 and reset 0 for a lifetime: capped for good at its limit)
--   I2 + bytes    the scope's channels: 2-byte digests, their length in bytes first (0: any channel)
--   I2 + bytes    the scope's tags, the same (0: any tags)
--   B  + bytes    the scope's campaign: 4-byte digest, its length first (0: any campaign)
--                 (one struct.unpack reads a cap whole; a cap of every send is 26 bytes)
--   c8 i8         a tally cap's only: its field, and until when its item is kept if the send is recorded
-- ARGV[1]  member of this send
-- ARGV[3]  in modeMark, the refusal's name; in modeAppend, the worker's copy of the log; in modeNewLog, the
--          new log; otherwise empty
-- KEYS[1]  the user's log, e.g. fc:{123} (the hash tag keeps a user's keys in one slot)
-- KEYS[2]  (with an arbitration window) the user's candidates, e.g. fc:{123}:arb (same slot): a hash of
--          member -> "priority:registered_ms:window_end_ms:seq" (seq: its order of registration)
-- KEYS[n]  (with prefs 1, last) the user's preferences, e.g. fc:{123}:prefs (same slot): a hash of
--          "c:<channel>" or "t:<tag>" -> the 2-byte digest of the channel or tag, then "<limit>:<window_ms>"
--          (the user's own limit of such sends in any window of that length; limit 0: opted out), and
--          "vip" -> ms until which the rules' caps do not apply to the user (their preferences do).
--          A send a preference refuses is not recorded (statusPreference, the field name after the counts).
--
-- Arbitration: a send that every cap allows but that would take the last slot of an arbitrated cap
-- that applies to it is not recorded: it becomes a candidate of the user's open window (or opens one,
-- ending window ms from now) and must come back at its end (statusCandidate). When a candidate comes back at
-- or after its window's end, the window's highest priority (ties: the earliest registered, in the order of
-- registration within a millisecond) is decided
-- as any send; the others are capped by that cap (statusCapped), unless the slot is no longer the last
-- (then there is room for them too). Sends that do not need the last slot never touch KEYS[2].
-- A candidate is forgotten max(window, 60 s) after its window ends, so a job that never comes back
-- cannot hold the slot; a redelivered candidate is recognised by its member.
--
-- A cap applies to this send when the send's member matches its scope, and counts the entries that match.
-- Reply: one per request, in order; an error reply for a request that failed, else one string, packed
-- big-endian (a table of integers costs the script a Lua table and Redis a reply element per value):
--   B status, I2 cap, i8 retry_at, I4 count_1 ... count_n (the request's caps), then the rest (below)
--   status    statusAllowed (1): allowed (recorded in modeRecord and modeExact); statusCapped (0): capped;
--             statusDuplicate (2): this member is already in the log, i.e. the job was allowed before,
--             statusCandidate (3): send it again at retry_at, the end of its arbitration window (cap: the cap),
--             statusPreference (4): capped by one of the user's preferences (cap 0; the preference's field follows the counts),
--             statusRefused (5): refused before: the job is marked refused (see the log below; cap 0, counts 0, the
--               refusal's name follows the counts); in modeMark, statusAllowed means marked now and
--               statusDuplicate a duplicate
--   cap       1-based index of the cap that decides retry_at; 0 unless capped
--   retry_at  ms at which every exceeded cap passes again; 0 when capped for good (a limit of 0);
--             for a duplicate, the ms at which the job was recorded; for an allowed send, the ms it is
--             recorded at: now, or the log's latest entry if that is later (another worker's clock read
--             later but its script ran first), so a user's log is in the order its decisions were taken
--   count_i   entries of cap i's scope in its window before this decision
--   rest      statusPreference and statusRefused: the preference's field or the refusal's name; otherwise, when maxlog allows
--             it (the worker's near cache is on): with status + statusWhole (128), the log after this decision whole (its
--             header, then its entries), when it holds no marks and nothing aged out; else, when a cap that
--             blocks is full after this decision, the log's entries after it (this send included when
--             recorded; no marks), oldest first, packed as the log packs them; else empty
--   A reply with statusWhole is not one string but an array: the packed values above, then the log whole in
--   pieces that the worker joins (the log as read, the entry appended): Redis 7's Lua hashes every byte of each
--   string a script makes, and joining the log to the reply cost a call two hashes of it (a 700-byte log: a
--   call's 3.3 us against 2.1 us, redis-benchmark of the two replies).
--   A request of modeAppend whose log is the worker's copy, or of modeNewLog written as a new log, is answered
--   replyWritten ('=') alone (recorded, as decided).
--
-- Cost: one GET of the log serves the duplicate check (one string.find) and every cap; a recorded send is
-- one APPEND, or one SET PX of the whole log when its TTL needs refreshing, entries aged out or the send goes
-- before the latest; a decision that records nothing writes nothing, a duplicate only refreshes the TTL.
-- scripts/bench-calls.sh measures a call against the seed's design.

-- The seam with capping/protocol.go, which declares constants of the same names and values
-- (TestSeamNamesAgree checks that the two lists agree): the modes of a request, the statuses of a reply, a cap's
-- flags, and the reply of a request written as the worker asked.
local modeLook = 0
local modeRecord = 1
local modeExact = 2
local modeMark = 3
local modeAppend = 4
local modeNewLog = 5
local modePatch = 6
local modeSpilled = 7
local statusCapped = 0
local statusAllowed = 1
local statusDuplicate = 2
local statusCandidate = 3
local statusPreference = 4
local statusRefused = 5
local statusWhole = 128
local flagShadow = 1
local flagArbitrated = 2
local flagApplies = 4
local flagTally = 8
local replyWritten = '='
local spillAt = 16

local headfmt = '>i8Bi8I2i8BB' -- a request's values: now, mode, retention, maxlog, window, priority, prefs
local capfmt = '>i8i4i8BI2c0I2c0Bc0' -- one cap's: since, limit, reset, flags, channels, tags, campaign
local entryhead = '>i8I2' -- an entry's score and member length, before the member
local itemhead = '>BB' -- a tally item's head (tallyhead) and member length, before the member
local tallyhead = 1 -- a tally item's first byte (an entry's is 0, a mark's 255: the first of its score)
local itemscore = 2 ^ 56 -- an item's first 8 bytes, read as an entry's score, are at least this
local tallyfmt = '>c8i8' -- a tally cap's, after its campaign: its field in the tally, until when to keep it
local tallyTimes = 16 -- the most send times a count keeps (capping.MaxTallyTimes)
-- A log holds at most spillAt tally items (a send that would add more moves them), so that a user's many counted
-- scopes cost only the sends that count one: the walk of a log reads its every item on every decision. Past it,
-- the items are in the user's tally key (the log's key and ':t', the same slot): items packed as in a log, no
-- header. The log holds one item instead, of the field spilledField (count 0, kept until the latest keep of the
-- tally key's items and the retention's slack, so the log outlives them; raised, with the key's TTL, only when a
-- send's keep passes it), which says so: a request with a tally cap reads the tally key (GET; an item found by
-- its field's bytes and its frame, see framedAt) and writes it (SETRANGE and APPEND in place; SET PX whole, lapsed
-- items left out, when an item changes its length), the others never touch it.
local spilledField = '\255\255\255\255\255\255\255\255'

-- load returns a user's log as a string (see the header) and whether the key holds a sorted set (an older
-- capper's log, converted here: the next write replaces it with the string).
local function load(key)
  local v = redis.pcall('GET', key)
  if type(v) ~= 'table' then
    return v or '', false
  end
  if not string.find(v.err or '', 'WRONGTYPE', 1, true) then
    error(v)
  end
  local raw = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES') -- marks (negative scores) first, then entries
  local parts = {}
  for i = 1, #raw, 2 do
    parts[#parts + 1] = struct.pack(entryhead, tonumber(raw[i + 1]), #raw[i]) .. raw[i]
  end
  return struct.pack('>i8', 0) .. table.concat(parts), true -- a TTL of 0: the next write sets one
end

-- has reports whether set, digests of #d bytes one after the other, holds d.
local function has(set, d)
  for i = 1, #set, #d do
    if string.sub(set, i, i + #d - 1) == d then
      return true
    end
  end
  return false
end

-- matches reports whether member m is in a scope: one of its channels, its campaign, one of its tags.
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

-- kth returns the score of the k-th oldest entry at or after since that the filter selects (nil if none):
-- the entry that must leave the window before a send passes again.
local function kth(members, scores, n, k, since, scoped, channels, tags, campaign)
  for j = 1, n do
    if scores[j] >= since and (not scoped or matches(members[j], channels, tags, campaign)) then
      k = k - 1
      if k == 0 then
        return scores[j]
      end
    end
  end
  return nil
end

-- entries returns the n kept entries of log (their members at starts, the first kept item at from; gap: an
-- item left out, a mark or an aged-out entry, lies among them) packed as in the log, with entry (packed) as
-- the j-th (1..n+1) when j is given. Kept entries one after the other, the usual case, are one string.sub.
local function entries(log, starts, n, from, gap, entry, j)
  if not gap and (not j or j == n + 1) then
    local s = from and string.sub(log, from) or ''
    return j and s .. entry or s
  end
  local parts = {}
  for i = 1, n do
    if i == j then
      parts[#parts + 1] = entry
    end
    local len = struct.unpack('>I2', log, starts[i] - 2)
    parts[#parts + 1] = string.sub(log, starts[i] - 10, starts[i] + len - 1)
  end
  if j == n + 1 then
    parts[#parts + 1] = entry
  end
  return table.concat(parts)
end

-- fieldLess orders tally fields as numbers: string order is the server's locale's (strcoll).
local function fieldLess(x, y)
  local x1, x2 = struct.unpack('>I4I4', x)
  local y1, y2 = struct.unpack('>I4I4', y)
  return x1 < y1 or (x1 == y1 and x2 < y2)
end

-- tallyItems returns the tally items of tally (field -> member; nil: none) packed as the log packs them, by
-- field: the same tally is the same bytes whichever decision wrote it.
local function tallyItems(tally)
  if not tally then
    return ''
  end
  local fields = {}
  for field in pairs(tally) do
    fields[#fields + 1] = field
  end
  table.sort(fields, fieldLess)
  local parts = {}
  for i, field in ipairs(fields) do
    parts[i] = struct.pack(itemhead, tallyhead, #tally[field]) .. tally[field]
  end
  return table.concat(parts)
end

-- save writes a user's log (read as log, its header saying until when its TTL was set; rewrite when it must be
-- written whole: items in it aged out, or it is a sorted set; marks and n entries kept, their members at
-- starts, from and gap as entries takes them: see decide) with item (a packed entry or mark) added: a mark
-- first, an entry as the j-th (1..n+1).
-- An entry after the others is appended (APPEND writes and replicates the entry alone) while the TTL left
-- covers the retention; otherwise the log is written whole (spliced, or packed from what is kept) with a new
-- TTL, now + ttl in its header. The header is the worker's clock and the TTL the server's, counted from the
-- write: they agree but for the skew between workers, which the retention's margin covers; a TTL set
-- elsewhere (a duplicate's PEXPIRE) is only ever longer than the header says.
local function save(key, now, ttl, retention, log, expires, rewrite, marks, tally, starts, n, from, gap, item, mark, j)
  if expires - now >= retention and not rewrite and not mark and j == n + 1 then
    redis.call('APPEND', key, item)
    return nil
  end
  local body
  if not rewrite then
    local at = 9 -- a mark's place, or the entry's: before the j-th entry (its score 10 bytes before its member)
    if not mark then
      at = j <= n and starts[j] - 10 or math.max(#log, 8) + 1
    end
    body = string.sub(log, 9, at - 1) .. item .. string.sub(log, at)
  else
    local parts = {}
    if mark then
      parts[1] = item
    end
    for i = 1, marks and #marks or 0 do
      parts[#parts + 1] = marks[i]
    end
    parts[#parts + 1] = tallyItems(tally)
    if mark then
      parts[#parts + 1] = entries(log, starts, n, from, gap)
    else
      parts[#parts + 1] = entries(log, starts, n, from, gap, item, j)
    end
    body = table.concat(parts)
  end
  local value = struct.pack('>i8', now + ttl) .. body
  redis.call('SET', key, value, 'PX', ttl)
  return value
end

-- patchLog records an entry (packed) after the n entries of log, with the tally items the send changed
-- (changed: field -> the item's member after the send) as modePatch writes a worker's patch: an item the log
-- holds (its member at where[field]) written in place, the new ones (by field) and the entry appended in one
-- APPEND, and a new header and TTL (now + ttl) only when the log's header no longer covers the retention or the
-- items' keep (tkeep, the latest). It writes nothing and returns nil when a counted item changes its length (a rolling
-- cap's times): save then writes the log whole. Otherwise it returns the log after it when whole is set (for
-- the caller's near cache), as pieces to be joined (see the reply in the header), else true.
local function patchLog(key, log, now, ttl, retention, expires, tkeep, changed, where, entry, whole)
  local edits, fresh = {}, nil -- fresh: the new items, field -> member
  for field, t in pairs(changed) do
    local at = where[field]
    if at then
      if #t ~= string.byte(log, at - 1) then
        return nil
      end
      edits[#edits + 1] = at
    else
      fresh = fresh or {}
      fresh[field] = t
    end
    tkeep = math.max(tkeep, struct.unpack('>i8', t, 13))
  end
  table.sort(edits)
  local parts = {}
  for i, at in ipairs(edits) do
    parts[i] = changed[string.sub(log, at, at + 7)]
    redis.call('SETRANGE', key, at - 1, parts[i])
  end
  local tail = tallyItems(fresh) .. entry
  redis.call('APPEND', key, tail)
  local header = nil
  if expires - now < retention or expires < tkeep then
    header = struct.pack('>i8', now + ttl)
    redis.call('SETRANGE', key, 0, header)
    redis.call('PEXPIRE', key, ttl)
  end
  if not whole then
    return true
  end
  if not header and #edits == 0 then -- the log as read, then what was appended (no string made of the log)
    return { log, tail }
  end
  local out, p = { header or string.sub(log, 1, 8) }, 9
  for i, at in ipairs(edits) do
    out[#out + 1] = string.sub(log, p, at - 1)
    out[#out + 1] = parts[i]
    p = at + #parts[i]
  end
  out[#out + 1] = string.sub(log, p)
  out[#out + 1] = tail
  return out
end

-- list returns the members of the n entries of log whose members start at starts[1..n].
local function list(log, starts, n)
  local members = {}
  for i = 1, n do
    members[i] = struct.unpack('>I2c0', log, starts[i] - 2)
  end
  return members
end

-- answer packs a request's reply (see the header): status, cap, retry_at, then each of the ncaps counts.
local answers = {} -- struct formats by number of caps
local function answer(status, hit, retry_at, counts, ncaps)
  local f = answers[ncaps]
  if not f then
    f = '>BI2i8' .. string.rep('I4', ncaps)
    answers[ncaps] = f
  end
  return struct.pack(f, status, hit, retry_at, unpack(counts, 1, ncaps))
end

-- readLog reads a user's log (see load): the marks of refused sends, then the entries, oldest first. A send
-- refused for good (modeMark) is marked with score minus the time of its refusal plus its keep (how much longer
-- than the retention other copies may come: the rules' longest hold, after the request's header) and member
-- byte(#m) .. m .. the refusal's name, so that a later copy of the same job (a redelivery, a resend) is refused
-- too (statusRefused) rather than allowed: one final topic per job. Marks come first and count in no window;
-- the log's TTL covers them.
-- Entries and marks older than the retention are left out (a look keeps them) and dropped by the next write.
-- It returns the log and whether it is a sorted set; each kept entry's score, and where its member starts in
-- log (the members are made into strings only when a step needs them: a scoped cap, preferences, the near
-- cache's copy; see list, so that reading an entry costs one struct.unpack and no string), and their number;
-- the kept marks as packed (nil: none) and the refusals by member; how many items aged out; where the first
-- kept entry starts and whether an item left out follows it; the header's expiry (see save); and the kept
-- tally items' member starts (nil: none; read by itemOf and tallyOf, no string made for an item no cap counts)
-- with their latest keep; and where the spill item's member starts (nil: none; the tally is in the tally key).
local function readLog(key, record, now, retention)
  local log, zset = load(key)
  local scores, starts, n = {}, {}, 0
  local marks, refused, stale = nil, nil, 0
  local items, tkeep, spill = nil, 0, nil
  local from, gap = nil, false
  local horizon = now - retention
  local pos, size, expires = 9, #log, 0 -- none in an empty log
  if size > 0 then
    expires = struct.unpack('>i8', log, 1)
  end
  while pos <= size do
    local s, len, at = struct.unpack(entryhead, log, pos)
    if s >= itemscore then -- a tally item (its first byte tallyhead)
      len, at = string.byte(log, pos + 1), pos + 2
    end
    local nxt = at + len
    if nxt > size + 1 then
      error('data string too short') -- as struct.unpack says it: see run
    end
    if s >= itemscore then -- a tally item: kept until its keep
      local keep = struct.unpack('>i8', log, at + 12)
      if not record or keep >= now then
        items = items or {}
        items[#items + 1] = at
        tkeep = math.max(tkeep, keep)
        if string.byte(log, at) == 255 and string.sub(log, at, at + 7) == spilledField then
          spill = at
        end
      else
        stale = stale + 1
      end
      gap = gap or from ~= nil
    elseif s < 0 then
      if not record or -s > horizon then
        local m = string.sub(log, at, nxt - 1)
        len = string.byte(m, 1)
        refused, marks = refused or {}, marks or {}
        refused[string.sub(m, 2, 1 + len)] = string.sub(m, 2 + len)
        marks[#marks + 1] = string.sub(log, pos, nxt - 1)
        tkeep = math.max(tkeep, retention - s) -- the log outlives the mark
      else
        stale = stale + 1
      end
      gap = gap or from ~= nil
    elseif not record or s > horizon then
      n = n + 1
      scores[n], starts[n] = s, at
      from = from or pos
    else
      stale = stale + 1
      gap = gap or from ~= nil
    end
    pos = nxt
  end
  return log, zset, scores, starts, n, marks, refused, stale, from, gap, expires, items, tkeep, spill
end

-- itemStarts returns the member starts of the tally items packed in t (a tally key's value), lapsed ones too: one
-- string.byte an item.
local function itemStarts(t)
  local items, k, pos, size = {}, 0, 1, #t
  while pos <= size do
    k = k + 1
    items[k] = pos + 2
    pos = pos + 2 + (string.byte(t, pos + 1) or size)
  end
  if pos ~= size + 1 then
    error('data string too short') -- as struct.unpack says it: see run
  end
  return items
end

-- framed stands for a tally key's item starts in itemOf: a user's tally key may hold hundreds of items, and
-- walking them (itemStarts) on each send that counts one was most of its cost (BenchmarkManyScopes: 0.41 of
-- the rate of users without a tally at 500 scopes, 0.72 without the walk); an item is told by its frame instead
-- (see framedAt). Only a write of the key whole walks it.
local framed = {}

-- readSpilled reads a spilled log's tally key (see spilledField): its value, and framed for its items' starts.
local function readSpilled(tkey)
  return redis.call('GET', tkey) or '', framed
end

-- framedAt reports whether the bytes of a field found at p in a tally key's value t start an item: a tally head
-- and a member length before them (20, or 20 and up to tallyTimes times), and the item ends where t ends or the
-- next item's head starts. Bytes that match a field and this frame elsewhere (inside another item's field, count,
-- keep or times) are as likely as two scopes' fields being one digest, which capper takes already (a field is
-- 8 bytes of a digest, a campaign's 4).
local function framedAt(t, p)
  local head, len = string.byte(t, p - 2, p - 1)
  if head ~= tallyhead or not len or len < 20 or len > 20 + 8 * tallyTimes or (len - 20) % 8 ~= 0 then
    return false
  end
  local after = p + len
  return after == #t + 1 or (after <= #t and string.byte(t, after) == tallyhead)
end

-- itemOf returns the member of log's tally item of field (items: the items' member starts, in order, or framed;
-- nil: none) and where it starts; or nil and where it starts if it lapsed (kept until before now), nil and nil if
-- there is none: the field's bytes found in the log (string.find), then checked to start an item (a binary
-- search of items, or its frame). No string is made for the log's other items.
local function itemOf(log, items, field, now)
  if not items then
    return nil, nil
  end
  local p = string.find(log, field, 1, true)
  while p do
    local found = false
    if items == framed then
      found = p > 2 and framedAt(log, p)
    else
      local lo, hi = 1, #items
      while lo <= hi do
        local mid = math.floor((lo + hi) / 2)
        local at = items[mid]
        if at == p then
          found = true
          break
        elseif at < p then
          lo = mid + 1
        else
          hi = mid - 1
        end
      end
    end
    if found then
      if struct.unpack('>i8', log, p + 12) < now then
        return nil, p
      end
      return string.sub(log, p, p + string.byte(log, p - 1) - 1), p
    end
    p = string.find(log, field, p + 1, true)
  end
  return nil, nil
end

-- tallyOf returns log's kept tally items (their member starts in items) by field, with the members of changed
-- (field -> member) in place of theirs, or nil if there are none: what the log holds after a send that
-- changed them, for the log written whole or sent to the near cache.
local function tallyOf(log, items, changed)
  local tally = nil
  for i = 1, items and #items or 0 do
    local at = items[i]
    tally = tally or {}
    tally[string.sub(log, at, at + 7)] = string.sub(log, at, at + string.byte(log, at - 1) - 1)
  end
  for field, t in pairs(changed or {}) do
    tally = tally or {}
    tally[field] = t
  end
  return tally
end

-- saveSpilled writes the tally items a send changed (changed: field -> the item's member after the send; where:
-- field -> its member's start in tlog, the tally key's value read with its items' starts, titems; nil: a new
-- item) to the tally key tkey: each in place and the new ones appended, or, when an item changes its length,
-- the key written whole without the items that lapsed (kept until before now). Its TTL is set to ttl from now
-- (at least its items' keeps) when it is written whole or was missing, or when raise says the spill item's keep
-- rose (else the TTL set with that keep still covers every item's).
local function saveSpilled(tkey, tlog, titems, changed, where, now, ttl, raise)
  local whole = false
  for field, t in pairs(changed) do
    whole = whole or (where[field] and #t ~= string.byte(tlog, where[field] - 1))
  end
  if whole then
    local kept = {}
    for _, at in ipairs(titems == framed and itemStarts(tlog) or titems) do
      if struct.unpack('>i8', tlog, at + 12) >= now then
        kept[#kept + 1] = at
      end
    end
    redis.call('SET', tkey, tallyItems(tallyOf(tlog, kept, changed)), 'PX', ttl)
    return
  end
  local fresh = nil -- the new items, field -> member
  for field, t in pairs(changed) do
    if where[field] then
      redis.call('SETRANGE', tkey, where[field] - 1, t)
    else
      fresh = fresh or {}
      fresh[field] = t
    end
  end
  if fresh then
    redis.call('APPEND', tkey, tallyItems(fresh))
  end
  if raise or tlog == '' then
    redis.call('PEXPIRE', tkey, ttl)
  end
end

-- spillItem returns a spilled log's item (its member) with keep as its keep: see spilledField.
local function spillItem(keep)
  return spilledField .. struct.pack('>I4i8', 0, keep)
end

-- duplicateOf returns the score of the kept entry whose member is member (found as bytes in log, then checked
-- to be one whole member), or nil.
local function duplicateOf(log, member, scores, starts, n)
  local hit_at = string.find(log, member, 1, true)
  while hit_at do
    for j = n, 1, -1 do
      if starts[j] == hit_at then
        if struct.unpack('>I2', log, hit_at - 2) == #member then
          return scores[j]
        end
        break
      end
    end
    hit_at = string.find(log, member, hit_at + 1, true)
  end
  return nil
end

-- refusedAgain is the reply to a send marked refused before: nothing recorded, a count of 0 per cap (the caps
-- are packed from position first on), the refusal's name after them.
local function refusedAgain(packed, first, refusal)
  local k, p = 0, first
  while p <= #packed do
    p = select(8, struct.unpack(capfmt, packed, p))
    k = k + 1
  end
  return struct.pack('>BI2i8', statusRefused, 0, 0) .. string.rep('\0\0\0\0', k) .. refusal
end

-- tallied counts the sends of a tally item's member t (nil: none; see the header) in a window from since
-- (reset 0: every send counted, ever) and returns their number and, when k is given, the time of the k-th
-- oldest of them in the window (nil if none).
local function tallied(t, since, reset, k)
  if not t then
    return 0, nil
  end
  if reset == 0 then
    return (struct.unpack('>I4', t, 9)), nil
  end
  local count, kth_at = 0, nil
  for p = 21, #t - 7, 8 do
    local at = struct.unpack('>i8', t, p)
    if at >= since then
      count = count + 1
      if count == k then
        kth_at = at
      end
    end
  end
  return count, kth_at
end

-- counted returns tally item member t (nil: a new one, of field) with one more send at now: its count plus
-- one, kept until the later of its keep and keep, and, when timed (a rolling cap's), now added to its times
-- (the last tallyTimes kept).
local function counted(t, field, keep, timed, now)
  local count, kept, times = 0, 0, ''
  if t then
    count, kept = struct.unpack('>I4i8', t, 9)
    times = string.sub(t, 21)
  end
  if timed then
    times = times .. struct.pack('>i8', now)
    if #times > 8 * tallyTimes then
      times = string.sub(times, -8 * tallyTimes)
    end
  else
    times = ''
  end
  return field .. struct.pack('>I4i8', count + 1, math.max(kept, keep)) .. times
end

-- countAll counts a send in the tally items of updates (field -> {keep, timed}: the caps that count it), found in
-- tlog (its items' starts titems, or framed) and returns where each is (field -> its member's start; none: a new
-- item), its member after the send (field -> member), ttl raised to outlast their keeps by slack, how many are new
-- and the latest of their keeps.
local function countAll(tlog, titems, updates, now, ttl, slack)
  local where, changed, fresh, keep = {}, {}, 0, 0
  for field, u in pairs(updates) do
    local t
    t, where[field] = itemOf(tlog, titems, field, now)
    changed[field] = counted(t, field, u[1], u[2], now)
    ttl = math.max(ttl, u[1] - now + slack)
    fresh, keep = fresh + (where[field] and 0 or 1), math.max(keep, u[1])
  end
  return where, changed, ttl, fresh, keep
end

-- saveCounted writes a spilled log's counted items (changed and where, as countAll returns them; keep the latest of
-- their keeps) to the tally key, and returns the log's own change (field -> member, field -> its start, as
-- patchLog takes them) and whether there is one: the spill item (its member at spill) kept a slack past keep when
-- keep passes its own, so that the next keeps of a rule's retain, a little later each, change neither key for a
-- while.
local function saveCounted(key, log, spill, tlog, titems, changed, where, now, ttl, keep, slack)
  local raise = keep > struct.unpack('>i8', log, spill + 12)
  saveSpilled(key .. ':t', tlog, titems, changed, where, now, ttl, raise)
  local logged, lwhere = {}, {}
  if raise then
    logged[spilledField], lwhere[spilledField] = spillItem(keep + slack), spill
  end
  return logged, lwhere, raise
end

-- capCounts counts each cap of the request (packed from position first on) over the kept entries and decides
-- the send by them (status: statusAllowed, or statusDuplicate found before). Per cap, in plain locals (a table
-- per cap costs more than the counting): its count goes into counts, and whether a blocking cap is full after
-- the decision into two flags, one for an allowed send (it counts where it applies) and one for any other
-- (full0, full1: see the near cache's log in cacheReply). A tally cap counts from the log's items, or from the
-- tally key's when tkey names it (a spilled log: read at the first tally cap). It returns the status, the
-- 1-based cap that decides retry_at (hit), retry_at, whether a limit of 0 refused it (never), the counts and
-- their number, full0 and full1, an arbitrated cap at its last slot (last) with when a slot frees after it is
-- taken (last_at), the members if it listed them, the tally items of the caps that count the send (field ->
-- {keep, timed}), and the tally the caps read: its string and its items' starts (see readSpilled).
local function capCounts(packed, first, member, log, scores, starts, n, now, status, items, tkey)
  local tlog, titems = log, items
  local members = nil
  local updates = nil
  local counts, ncaps, full0, full1 = {}, 0, false, false
  local hit, retry_at, never = 0, 0, false
  local last, last_at = nil, 0
  local pos = first
  while pos <= #packed do
    local since, limit, reset, flags, channels, tags, campaign
    since, limit, reset, flags, channels, tags, campaign, pos = struct.unpack(capfmt, packed, pos)
    local shadow, arbitrated = flags % (2 * flagShadow) >= flagShadow, flags % (2 * flagArbitrated) >= flagArbitrated
    local scoped = channels ~= '' or tags ~= '' or campaign ~= ''
    local applies = not scoped or flags % (2 * flagApplies) >= flagApplies or matches(member, channels, tags, campaign)
    local field, keep = nil, 0
    if flags % (2 * flagTally) >= flagTally then
      field, keep, pos = struct.unpack(tallyfmt, packed, pos)
    end
    -- count the entries of its scope in its window; the log is oldest first, so a cap of every send
    -- counts from the newest entry back (a tally cap: its field's sends in the tally)
    local count = 0
    if field and tkey then
      tlog, titems = readSpilled(tkey)
      tkey = nil
    end
    if field then
      count = tallied(itemOf(tlog, titems, field, now), since, reset)
      if applies then
        updates = updates or {}
        local u = updates[field] or { 0, reset > 0 }
        updates[field] = { math.max(u[1], keep), u[2] }
      end
    elseif scoped then
      members = members or list(log, starts, n)
      for j = 1, n do
        if scores[j] >= since and matches(members[j], channels, tags, campaign) then
          count = count + 1
        end
      end
    else
      local j = n
      while j > 0 and scores[j] >= since do
        j = j - 1
      end
      count = n - j
    end
    ncaps = ncaps + 1
    counts[ncaps] = count
    if not shadow then
      full0 = full0 or count >= limit
      full1 = full1 or count + (applies and 1 or 0) >= limit
    end
    if arbitrated and not shadow and applies and count == limit - 1 and not last then
      last, last_at = ncaps, -reset
      if reset > 0 then -- once the last slot is taken, the oldest entry frees one
        last_at = (kth(members, scores, n, 1, since, scoped, channels, tags, campaign) or now) + reset
      end
    end
    if not shadow and status ~= statusDuplicate and count >= limit and applies then
      status = statusCapped
      local at = -reset
      if field and reset > 0 then
        at = (select(2, tallied(itemOf(tlog, titems, field, now), since, reset, count - limit + 1)) or 0) + reset
      elseif reset > 0 then -- none only with a limit of 0, which never passes
        at = (kth(members, scores, n, count - limit + 1, since, scoped, channels, tags, campaign) or 0) + reset
      end
      if limit == 0 or (field and reset == 0) then -- a lifetime cap reached never passes again
        if not never then hit = ncaps end
        never = true
      elseif not never and at > retry_at then
        hit, retry_at = ncaps, at
      end
    end
  end
  if never then
    retry_at = 0
  end
  return status, hit, retry_at, never, counts, ncaps, full0, full1, last, last_at, members, updates, tlog, titems
end

-- preference applies the user's preferences (see KEYS[n], read as the HGETALL p) to a send the rules' caps
-- decided (status, hit, retry_at, never, last): a VIP exemption lifts the rules' caps and their arbitration;
-- the user's own limits and opt-outs still apply. It returns the decision after them, and the field of the
-- preference that refused the send (statusPreference), or nil.
local function preference(p, member, members, scores, n, now, status, hit, retry_at, never, last)
  for j = 1, #p, 2 do
    if p[j] == 'vip' and tonumber(p[j + 1]) > now then
      status, hit, retry_at, never, last = statusAllowed, 0, 0, false, nil
    end
  end
  local pref, p_at, p_never = nil, 0, false
  for j = 1, #p, 2 do
    local kind = string.sub(p[j], 1, 2)
    if kind == 'c:' or kind == 't:' then
      local d = string.sub(p[j + 1], 1, 2)
      local l, w = string.match(string.sub(p[j + 1], 3), '^(%d+):(%d+)$')
      l, w = tonumber(l), tonumber(w)
      local function sel(m)
        if kind == 'c:' then
          return string.sub(m, 9, 10) == d
        end
        for i = 15, #m - 1, 2 do
          if string.sub(m, i, i + 1) == d then
            return true
          end
        end
        return false
      end
      if l and sel(member) then
        local count, picked = 0, {}
        for i = 1, n do
          if scores[i] > now - w and sel(members[i]) then
            count = count + 1
            picked[count] = scores[i]
          end
        end
        if count >= l then
          if l == 0 then
            if not p_never then
              pref = p[j]
            end
            p_never = true
          elseif not p_never and picked[count - l + 1] + w > p_at then
            p_at, pref = picked[count - l + 1] + w, p[j]
          end
        end
      end
    end
  end
  if pref and (status == statusAllowed or p_never or (status == statusCapped and not never and p_at > retry_at)) then
    status, hit, retry_at = statusPreference, 0, p_at
    if p_never then
      retry_at = 0
    end
  else
    pref = nil
  end
  return status, hit, retry_at, last, pref
end

-- arbitrate decides a send that every cap allows but that would take the last slot (of the cap last, freed
-- again at last_at) of an arbitrated cap (see the header), so it costs nothing to the others. It returns the
-- status, hit and retry_at after the arbitration.
local function arbitrate(arbkey, member, record, now, window, priority, last, last_at)
  local grace = math.max(window, 60000)
  -- a candidate's value: priority:registered_ms:window_end_ms[:seq], seq its order of registration in the
  -- user's hash (an older capper's values have none: 0)
  local function fields(v)
    local p, r, e, q = string.match(v, '^(%d+):(%d+):(%d+):?(%d*)$')
    return tonumber(p), tonumber(r), tonumber(e), tonumber(q) or 0
  end
  -- One read of the user's candidates serves this send's own entry and its window's others.
  local all = redis.call('HGETALL', arbkey)
  local mine = nil
  for j = 1, #all, 2 do
    if all[j] == member then
      mine = all[j + 1]
      break
    end
  end
  local wend = nil
  if mine then
    local _, _, e = fields(mine)
    wend = e
    if e + grace <= now then -- forgotten: decided as a new send
      wend = nil
      if record then
        redis.call('HDEL', arbkey, member)
      end
    end
  end
  if wend and now < wend then -- a redelivery before its window ends
    return statusCandidate, last, wend
  elseif wend then -- back at its window's end: the best of its window takes the slot
    local best, bp, br, bq = nil, -1, 0, 0
    for j = 1, #all, 2 do
      local p, r, e, q = fields(all[j + 1])
      -- the highest priority; ties: the earliest registered, in registration order within a millisecond (the
      -- input's order: a user's jobs are on one partition, decided in order), then the member
      if e == wend and (p > bp or (p == bp and (r < br or (r == br and (q < bq or (q == bq and all[j] < best)))))) then
        best, bp, br, bq = all[j], p, r, q
      end
    end
    if record then
      redis.call('HDEL', arbkey, member)
    end
    if best ~= member then
      return statusCapped, last, last_at
    end
    return statusAllowed, 0, 0
  end
  -- a new candidate: join the user's open window, or open one
  wend = now + window -- a forgotten entry of this send's (HDEL above) ended before now: never joined
  local seq = 0
  for j = 2, #all, 2 do
    local _, _, e, q = fields(all[j])
    if e > now and e - window <= now and e < wend then
      wend = e
    end
    seq = math.max(seq, q)
  end
  if record then
    redis.call('HSET', arbkey, member, string.format('%d:%d:%d:%d', priority, now, wend, seq + 1))
    redis.call('PEXPIRE', arbkey, wend - now + grace)
  end
  return statusCandidate, last, wend
end

-- decide decides one request: its packed values (the header's fields read by the caller, then its caps from
-- position first on), member, refusal's name and the mark's keep (modeMark) and keys (KEYS[1..3]).
local function decide(packed, member, named, key, arbkey, prefkey, now, mode, retention, maxlog, window, priority, first,
    keep)
  local record = mode ~= modeLook
  local log, zset, scores, starts, n, marks, refused, stale, from, gap, expires, items, tkeep, spill =
    readLog(key, record, now, retention)

  -- ttl is the key's TTL after a write: the retention, or until its last tally item's keep if later, plus a
  -- slack (an eighth of the retention, at most an hour; with it, the next keeps of a rule's retain, a little
  -- later each, need no new TTL for a while: see modePatch).
  local slack = math.min(math.floor(retention / 8), 3600000)
  local ttl = math.max(retention, tkeep - now) + slack

  local status, recorded = statusAllowed, duplicateOf(log, member, scores, starts, n)
  if recorded then
    status = statusDuplicate
  end
  -- A send marked refused before: refused again, nothing recorded (its counts are not computed).
  local refusal = status ~= statusDuplicate and refused and refused[member]
  if refusal then
    return refusedAgain(packed, first, refusal)
  end
  if mode == modeMark then
    if status == statusAllowed then
      local m = string.char(#member) .. member .. named
      save(key, now, math.max(ttl, keep + retention + slack), retention, log, expires, zset or stale > 0, marks,
        tallyOf(log, items), starts, n, from, gap, struct.pack(entryhead, -(now + keep), #m) .. m, true)
      return struct.pack('>BI2i8', statusAllowed, 0, 0)
    end
    return struct.pack('>BI2i8', statusDuplicate, 0, recorded)
  end

  local hit, retry_at, never, counts, ncaps, full0, full1, last, last_at, members, updates, tlog, titems
  status, hit, retry_at, never, counts, ncaps, full0, full1, last, last_at, members, updates, tlog, titems =
    capCounts(packed, first, member, log, scores, starts, n, now, status, items, spill and key .. ':t')
  if status == statusDuplicate then
    retry_at = recorded
  end

  -- The user's preferences (see KEYS[n]): an exemption from the rules' caps, and the user's own limits.
  local pref, has_prefs = nil, false
  if prefkey and status ~= statusDuplicate then
    members = members or list(log, starts, n)
    local p = redis.call('HGETALL', prefkey)
    has_prefs = #p > 0
    status, hit, retry_at, last, pref = preference(p, member, members, scores, n, now, status, hit, retry_at, never, last)
  elseif prefkey and record and maxlog > 0 then -- a duplicate reads none, but must not leave a copy of their log
    has_prefs = redis.call('EXISTS', prefkey) == 1
  end

  if arbkey and window > 0 and status == statusAllowed and last then
    status, hit, retry_at = arbitrate(arbkey, member, record, now, window, priority, last, last_at)
  end

  if status == statusAllowed then
    if mode ~= modeExact and n > 0 and scores[n] > now then
      now = scores[n]
    end
    retry_at = now
  end
  -- the recorded entry's place among the kept entries, the entry packed, the log after it whole (in pieces), the log's tally
  -- items it changed (field -> member), and the log's tally whole when the send spilled it (field -> member)
  local added, entry, written, logged, ltally = nil, nil, nil, nil, nil
  if record and status == statusAllowed then
    local j = n + 1 -- the entry's place: after every entry at or before now (modeExact may go back in time)
    while j > 1 and scores[j - 1] > now do
      j = j - 1
    end
    entry = struct.pack(entryhead, now, #member) .. member
    local lwhere = nil -- field -> the log's item's member start (none: a new item)
    if updates then -- the tally items of the caps that count it: patched in, or in the log written whole
      local where, changed, fresh, keep
      where, changed, ttl, fresh, keep = countAll(tlog, titems, updates, now, ttl, slack)
      logged, lwhere = changed, where
      if spill then -- the tally key counts them
        logged, lwhere = saveCounted(key, log, spill, tlog, titems, changed, where, now, ttl, keep, slack)
      elseif (items and #items or 0) + fresh > spillAt then -- past spillAt: the items move to the tally key
        local tally = tallyOf(log, items, changed)
        for _, t in pairs(tally) do
          keep = math.max(keep, struct.unpack('>i8', t, 13))
        end
        redis.call('SET', key .. ':t', tallyItems(tally), 'PX', ttl)
        ltally = { [spilledField] = spillItem(keep + slack) }
      end
      if not ltally and not zset and stale == 0 and j == n + 1 and #log >= 8 then
        written = patchLog(key, log, now, ttl, retention, expires, tkeep, logged, lwhere, entry, maxlog > 0)
      end
    end
    if not written then
      local rewrite = zset or stale > 0 or updates ~= nil
      written = save(key, now, ttl, retention, log, expires, rewrite, marks,
        rewrite and (ltally or tallyOf(log, items, logged)), starts, n, from, gap, entry, false, j)
      written = written and { written } or { log, entry } -- written whole, or appended
    end
    n, added = n + 1, j
  elseif record and status == statusDuplicate then
    -- A duplicate writes too: the write advances this connection's replication offset past the earlier
    -- write of the same job, so a WAIT after the script waits for that too.
    redis.call('PEXPIRE', key, ttl)
  end

  if status == statusPreference then
    return answer(status, hit, retry_at, counts, ncaps) .. pref
  end

  -- The whole log for the caller's near cache, when it is header and kept entries alone (no marks, nothing
  -- aged out, a string): the cache then knows it byte for byte, decides the user's next sends from it and
  -- records an allowed one by modeAppend (see the header). statusWhole added says so.
  local copied = n + (ltally and 1 or items and #items or 0) -- a copy's entries and tally items: at most maxlog
  if record and maxlog > 0 and copied <= maxlog and not has_prefs and not zset and not marks and stale == 0 then
    local reply = { answer(status + statusWhole, hit, retry_at, counts, ncaps) }
    for _, p in ipairs(written or { log }) do
      reply[#reply + 1] = p
    end
    return reply
  end
  local reply = answer(status, hit, retry_at, counts, ncaps)

  -- The log for the caller's near cache, when a cap that blocks is full: the next send of its scope is
  -- capped, and the cache can tell so without a call until the log changes. Its tally items, then its kept
  -- entries, as the log packs them: one string, where member and score pairs cost a Lua string each and two
  -- reply elements.
  if record and maxlog > 0 and copied <= maxlog and not has_prefs then -- a user with preferences is never cached
    if status == statusCapped or (status == statusAllowed and full1) or (status ~= statusAllowed and full0) then
      if added then
        return reply .. tallyItems(ltally or tallyOf(log, items, logged)) ..
          entries(log, starts, n - 1, from, gap, entry, added)
      end
      return reply .. tallyItems(tallyOf(log, items)) .. entries(log, starts, n, from, gap)
    end
  end
  return reply
end

-- spilledSend records, in modeSpilled, a send of a user whose tally is in the tally key (see spilledField), the
-- log being the worker's copy (log, read: no marks, none aged out, no entry after now, its one tally item the
-- spill item) from which the worker decided the send's other caps: its tally caps (packed from position first on)
-- are counted from the tally key. It returns nil, having written nothing, when one refuses the send or would give
-- it an arbitrated cap's last slot, or the header no longer covers the retention (then the request is decided in
-- full); else, having recorded the send as decide would, its reply (see modeSpilled).
local function spilledSend(packed, first, member, key, log, now, retention)
  local spill = string.find(log, spilledField, 9, true)
  if not spill or string.byte(log, spill - 2) ~= tallyhead or string.byte(log, spill - 1) ~= 20 then
    return nil
  end
  local expires, skeep = struct.unpack('>i8', log, 1), struct.unpack('>i8', log, spill + 12)
  if expires - now < retention or skeep < now then
    return nil
  end
  local tkey, tlog = key .. ':t', nil
  local counts, updates = {}, {}
  local pos = first
  while pos <= #packed do
    local since, limit, reset, flags, channels, tags, campaign
    since, limit, reset, flags, channels, tags, campaign, pos = struct.unpack(capfmt, packed, pos)
    if flags % (2 * flagTally) >= flagTally then
      local field, keep
      field, keep, pos = struct.unpack(tallyfmt, packed, pos)
      local shadow, arbitrated = flags % (2 * flagShadow) >= flagShadow, flags % (2 * flagArbitrated) >= flagArbitrated
      local scoped = channels ~= '' or tags ~= '' or campaign ~= ''
      local applies = not scoped or flags % (2 * flagApplies) >= flagApplies or matches(member, channels, tags, campaign)
      tlog = tlog or redis.call('GET', tkey) or ''
      local count = tallied(itemOf(tlog, framed, field, now), since, reset)
      if applies and not shadow and (count >= limit or (arbitrated and count == limit - 1)) then
        return nil
      end
      counts[#counts + 1] = count
      if applies then
        local u = updates[field] or { 0, reset > 0 }
        updates[field] = { math.max(u[1], keep), u[2] }
      end
    end
  end
  -- as decide records it
  local slack = math.min(math.floor(retention / 8), 3600000)
  local where, changed, ttl, _, keep = countAll(tlog, framed, updates, now, math.max(retention, skeep - now) + slack, slack)
  local logged, lwhere, raise = {}, {}, false
  if next(changed) then
    logged, lwhere, raise = saveCounted(key, log, spill, tlog, framed, changed, where, now, ttl, keep, slack)
  end
  patchLog(key, log, now, ttl, retention, expires, skeep, logged, lwhere, struct.pack(entryhead, now, #member) .. member,
    false)
  return replyWritten .. (raise and '\1' or '\0') .. struct.pack('>' .. string.rep('I4', #counts), unpack(counts))
end

-- One call decides its requests in order (a user's later request sees its earlier ones), each atomically
-- (the whole call is). A request is ARGV[i..]: its packed values, member, refusal's name, then its 1 to 3
-- keys (its packed values say which). A request that fails (a key of another node's slot, of another type,
-- a runtime error) is answered with its error, the others with their replies.
local function run(KEYS, ARGV)
  local out, i = {}, 1
  while i <= #ARGV do
    local packed = ARGV[i]
    local now, mode, retention, maxlog, window, priority, prefs, first = struct.unpack(headfmt, packed)
    local key, arbkey, prefkey, j = ARGV[i + 3], nil, nil, i + 4
    if window > 0 then
      arbkey, j = ARGV[j], j + 1
    end
    if prefs == 1 then
      prefkey, j = ARGV[j], j + 1
    end
    local ok, reply, keep = true, nil, 0
    if mode == modeMark and #packed >= first + 7 then -- the mark's keep (Request.MarkFor) follows the header
      keep, first = struct.unpack('>i8', packed, first)
    elseif mode == modeAppend then -- append if the log is the worker's copy (a GET that fails, WRONGTYPE, is not it)
      if redis.pcall('GET', key) == ARGV[i + 2] and not (prefkey and redis.call('EXISTS', prefkey) == 1) then
        redis.call('APPEND', key, struct.pack(entryhead, now, #ARGV[i + 1]) .. ARGV[i + 1])
        reply = replyWritten
      else
        mode = modeRecord
      end
    elseif mode == modePatch then -- the worker's patch of its copy, if the log is its copy (and no preferences)
      local pos = first + 2
      first = pos + struct.unpack('>I2', packed, first) -- the caps follow the patch
      if redis.pcall('GET', key) == ARGV[i + 2] and not (prefkey and redis.call('EXISTS', prefkey) == 1) then
        local expiry, k
        expiry, k, pos = struct.unpack('>i8B', packed, pos)
        for _ = 1, k do
          local at, m
          at, m, pos = struct.unpack('>I4I2c0', packed, pos)
          redis.call('SETRANGE', key, at, m)
        end
        redis.call('APPEND', key, string.sub(packed, pos, first - 1) .. struct.pack(entryhead, now, #ARGV[i + 1]) .. ARGV[i + 1])
        if expiry > 0 then
          redis.call('SETRANGE', key, 0, struct.pack('>i8', expiry))
          redis.call('PEXPIRE', key, expiry - now)
        end
        reply = replyWritten
      else
        mode = modeRecord
      end
    elseif mode == modeSpilled then -- the worker's copy, its tally caps counted from the tally key
      if redis.pcall('GET', key) == ARGV[i + 2] and not (prefkey and redis.call('EXISTS', prefkey) == 1) then
        reply = spilledSend(packed, first, ARGV[i + 1], key, ARGV[i + 2], now, retention)
      end
      if not reply then
        mode = modeRecord
      end
    elseif mode == modeNewLog then -- a new log, if the user has none and no preferences
      if redis.call('EXISTS', key) == 0 and not (prefkey and redis.call('EXISTS', prefkey) == 1) then
        redis.call('SET', key, ARGV[i + 2], 'PX', struct.unpack('>i8', ARGV[i + 2]) - now)
        reply = replyWritten
      else
        mode = modeRecord
      end
    end
    if not reply then
      ok, reply = pcall(decide, packed, ARGV[i + 1], ARGV[i + 2], key, arbkey, prefkey, now, mode, retention, maxlog,
        window, priority, first, keep)
    end
    if not ok then
      local msg = type(reply) == 'table' and reply.err or tostring(reply)
      if string.find(msg, 'data string too short', 1, true) then -- struct.unpack ran past the end of the log
        msg = 'ERR ' .. key .. ' is not a log capper wrote (' .. msg .. ')'
      end
      reply = redis.error_reply(msg)
    end
    out[#out + 1] = reply
    i = j
  end
  return out
end

-- Called with EVAL or EVALSHA, the chunk runs from the top on every call, its local functions made anew;
-- capper loads it as a Redis 7 function library instead (capping.decideLibrary puts a
-- redis.register_function of run in place of the line below), whose functions are made once, when the
-- library loads, and are kept and replicated by the node.
return run(KEYS, ARGV)
