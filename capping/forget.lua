-- forget.lua: remove a send from a user's log (its delivery failed: the user never received it).
-- KEYS[1]  the user's log (a header and packed entries, see decide.lua; a sorted set of an older capper's)
-- ARGV[1]  the 8-byte digest of the job id (the first 8 bytes of its member; see capping.Member)
-- Reply: how many entries were removed (0: the job is not in the log; 1 otherwise).
local log = redis.pcall('GET', KEYS[1])
if type(log) == 'table' then -- a sorted set (WRONGTYPE), or another error
  if not string.find(log.err or '', 'WRONGTYPE', 1, true) then
    error(log)
  end
  local raw = redis.call('ZRANGE', KEYS[1], 0, -1)
  local n = 0
  for i = 1, #raw do
    if string.sub(raw[i], 1, 8) == ARGV[1] then
      redis.call('ZREM', KEYS[1], raw[i])
      n = n + 1
    end
  end
  return n
end
if not log then
  return 0
end
local kept, n, pos = {string.sub(log, 1, 8)}, 0, 9 -- the header (see decide.lua) stays
while pos <= #log do
  local s, m, nxt
  if string.byte(log, pos) == 1 then -- a tally item (see decide.lua): never removed
    s, m, nxt = 0, struct.unpack('>Bc0', log, pos + 1)
  else
    s, m, nxt = struct.unpack('>i8I2c0', log, pos)
  end
  if s > 0 and string.sub(m, 1, 8) == ARGV[1] then -- an entry of the job (a mark, a tally item is never removed)
    n = n + 1
  else
    kept[#kept + 1] = string.sub(log, pos, nxt - 1)
  end
  pos = nxt
end
if n > 0 and #kept == 1 then
  redis.call('DEL', KEYS[1])
elseif n > 0 then
  redis.call('SET', KEYS[1], table.concat(kept), 'KEEPTTL')
end
return n
