#!lua flags=no-writes
-- The walk: every block of the chain, one call per block (RedisIndex lookup_strategy "walk").
-- KEYS: block keys of the chain, in order. Returns {replica, leading count, ...}.
-- no-writes: it may run on read replicas and while Redis is out of memory.
local call = redis.call
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- alive[1..n]: the replicas holding every block so far; counts: each one's run length.
local alive = {}
local n = 0
local counts = {}
local flat = call('HGETALL', KEYS[1])
for j = 1, #flat, 2 do
  local e = flat[j + 1]
  if e == '0' or tonumber(e) > now then
    n = n + 1
    alive[n] = flat[j]
    counts[flat[j]] = 1
  end
end
-- Past block 0 only the replicas still in the run matter: HGET / HMGET just those,
-- filtering alive in place (the walk costs one call per block, no tables).
local i = 2
local nkeys = #KEYS
while i <= nkeys and n > 0 do
  local m = 0
  if n == 1 then
    local e = call('HGET', KEYS[i], alive[1])
    if e and (e == '0' or tonumber(e) > now) then
      m = 1
      counts[alive[1]] = i
    end
  else
    local vals = call('HMGET', KEYS[i], unpack(alive, 1, n))
    for j = 1, n do
      local e = vals[j]
      if e and (e == '0' or tonumber(e) > now) then
        m = m + 1
        alive[m] = alive[j]
        counts[alive[j]] = i
      end
    end
  end
  n = m
  i = i + 1
end
local out = {}
for r, c in pairs(counts) do
  out[#out + 1] = r
  out[#out + 1] = c
end
return out
