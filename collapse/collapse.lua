#!lua flags=allow-cross-slot-keys
-- collapse.lua: users' collapse keys, one hash per user (PREFIX:{USER_ID}:k, in the slot of the user's log): field
-- the collapse key, value struct '>i8i8I2' then two job ids:
--   since      the submission time (ms) of the newest send of the key seen so far
--   delivered  when a send of the key was last forwarded (ms); 0: never (or not recorded: no window)
--   n          the length of the newest send's job id, which follows; then the last forwarded send's job id
-- A call carries the sends of one node (the worker sends up to 32 a call: a call's own cost and its arguments'
-- parsing are paid once), handled in order. KEYS[1] is the first send's hash (it routes the call); every
-- send's hash is among its values (allow-cross-slot-keys: undeclared keys of the node's slots; a key of
-- another node's slot fails its send alone, reply '!', and the worker asks again once it knows the slot's
-- node). ARGV[1] the operation, 'check' or 'sent'; ARGV[2] now (ms, the worker's clock); then per send 6 values:
--   the hash, the key, the job id, at (i8 ms: check's the send's submission time, sent's when it was
--   forwarded), the window (ms, 0: none), retain (ms): the hash expires this long after its last write, and a
--   field whose newest send is older than that is dropped when a write adds a field to a hash of more than
--   pruneAt fields.
-- check: the send becomes the key's newest unless a newer one was seen (later submission; at the same time, a
-- greater job id; a copy of the newest, a redelivery or a resend of its job, is never older than it), and its
-- reply pair says whether it must collapse: '', '' it may go; job, 'newer' a newer send of the key, job, was
-- seen; job, 'window' job, another send of the key, was forwarded within the window.
-- sent: job was forwarded at at (kept if it is the latest such time). Its reply pair is '', ''.
-- Reply: a pair per send, in order ('!' and the error for a send that failed).
local op, now = ARGV[1], tonumber(ARGV[2])
local pruneAt = 64

local function one(key, field, job, at, window, retain)
  local since, delivered, newest, djob = -1, 0, '', ''
  local v = redis.call('HGET', key, field)
  if v then
    local n, pos
    since, delivered, n, pos = struct.unpack('>i8i8I2', v)
    newest = string.sub(v, pos, pos + n - 1)
    djob = string.sub(v, pos + n)
  end
  local by, why, write = '', '', false
  if op == 'check' then
    if newest == job then -- another copy of the newest: it stays the newest, as of its latest copy
      if at > since then
        since, write = at, true
      end
    elseif since > at or (since == at and newest > job) then
      by, why = newest, 'newer'
    else
      since, newest, write = at, job, true
    end
    if by == '' and window > 0 and djob ~= '' and djob ~= job and delivered > now - window then
      by, why = djob, 'window'
    end
  elseif at >= delivered then
    delivered, djob, write = at, job, true
    if since < 0 then -- forwarded without a check (it cannot be: check registers first); it is the newest known
      since, newest = at, job
    end
  end
  if write then
    local added = redis.call('HSET', key, field, struct.pack('>i8i8I2', since, delivered, #newest) .. newest .. djob)
    redis.call('PEXPIRE', key, retain)
    if added == 1 and redis.call('HLEN', key) > pruneAt then
      local all = redis.call('HGETALL', key)
      for i = 1, #all, 2 do
        local s, d = struct.unpack('>i8i8', all[i + 1])
        if math.max(s, d) < now - retain then
          redis.call('HDEL', key, all[i])
        end
      end
    end
  end
  return by, why
end

local out = {}
for i = 3, #ARGV, 6 do
  local ok, by, why = pcall(one, ARGV[i], ARGV[i + 1], ARGV[i + 2], tonumber(ARGV[i + 3]), tonumber(ARGV[i + 4]),
    tonumber(ARGV[i + 5]))
  if ok then
    out[#out + 1], out[#out + 2] = by, why
  else
    out[#out + 1], out[#out + 2] = '!', type(by) == 'table' and (by.err or '') or tostring(by)
  end
end
return out
