-- collapse.lua: a user's collapse keys, one hash per user (KEYS[1], PREFIX:{USER_ID}:k, in the slot of the
-- user's log): field the collapse key, value struct '>i8i8I2' then two job ids:
--   since      the submission time (ms) of the newest send of the key seen so far
--   delivered  when a send of the key was last forwarded (ms); 0: never (or not recorded: no window)
--   n          the length of the newest send's job id, which follows; then the last forwarded send's job id
-- ARGV[1] the operation: 'check' or 'sent'; ARGV[2] the key; ARGV[3] the send's job id; ARGV[4] i8 ms: check's
-- the send's submission time, sent's when it was forwarded; ARGV[5] now (ms, the worker's clock); ARGV[6] the
-- window (ms, 0: none); ARGV[7] retain (ms): the hash expires this long after its last write, and a field
-- whose newest send is older than that is dropped when a write finds the hash has more than pruneAt fields.
-- check: the send becomes the key's newest unless a newer one was seen (later submission; at the same time, a
-- greater job id; a copy of the newest, a redelivery or a resend of its job, is never older than it), and the reply says whether it must collapse: {'', ''} it may go; {job, 'newer'} a newer
-- send of the key, job, was seen; {job, 'window'} job, another send of the key, was forwarded within the window.
-- sent: job was forwarded at ARGV[4] (kept if it is the latest such time). Reply {'', ''}.
local key, field, job, at, now, window, retain = KEYS[1], ARGV[2], ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]),
  tonumber(ARGV[6]), tonumber(ARGV[7])
local pruneAt = 64
local since, delivered, newest, djob = -1, 0, '', ''
local v = redis.call('HGET', key, field)
if v then
  local n, pos
  since, delivered, n, pos = struct.unpack('>i8i8I2', v)
  newest = string.sub(v, pos, pos + n - 1)
  djob = string.sub(v, pos + n)
end
local by, why, write = '', '', false
if ARGV[1] == 'check' then
  if newest == job then -- another copy of the newest (a redelivery, a resend): it stays the newest, as of its latest copy
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
  redis.call('HSET', key, field, struct.pack('>i8i8I2', since, delivered, #newest) .. newest .. djob)
  redis.call('PEXPIRE', key, retain)
  if redis.call('HLEN', key) > pruneAt then
    local all = redis.call('HGETALL', key)
    for i = 1, #all, 2 do
      local s, d = struct.unpack('>i8i8', all[i + 1])
      if math.max(s, d) < now - retain then
        redis.call('HDEL', key, all[i])
      end
    end
  end
end
return {by, why}
