#!lua flags=no-writes
-- The bisection: O(log n) probes per replica holding block 0 (the default lookup).
-- KEYS: [1] block 0's key (it names the scope's slot; the other blocks' keys are built
-- from ARGV, in the same slot). ARGV: [1] the chain, 8 big-endian bytes per block,
-- [2] block key prefix, [3] reverse index prefix (NS:{M}:r:), [4] TTL flag prefix
-- (NS:{M}:t:), [5] hole flag prefix (NS:{M}:h:). Returns {replica, leading count, ...},
-- the walk's answer (router/index/__init__.py, Lookup).
-- no-writes: it may run on read replicas and while Redis is out of memory.
local call = redis.call
-- A run's blocks are checked against the reverse index this many per ZMSCORE (Lua's
-- unpack has a stack limit of a few thousand values).
local CHUNK = 1024
local t = call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local chain, bprefix, rprefix, tprefix, hprefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local n = string.len(chain) / 8
local function member(i)
  return string.sub(chain, 8 * i - 7, 8 * i)
end
local function alive(e)
  return e and (e == '0' or tonumber(e) > now)
end
local function held(r, i)
  return alive(call('HGET', bprefix .. member(i), r))
end
-- r may hold entries that expire, which can leave an expired hole anywhere: one block
-- at a time, as the walk does.
local function walk(r)
  local i = 1
  while i < n and held(r, i + 1) do i = i + 1 end
  return i
end
-- The last block r holds, were its blocks of the chain a prefix (block 1 is held):
-- block lo held, block hi not (invariant), so O(log n) probes.
local function bisect(r)
  if held(r, n) then return n end
  local lo, hi = 1, n
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if held(r, mid) then lo = mid else hi = mid end
  end
  return lo
end
-- The run of blocks 1..last that r's reverse index holds: cuts the bisection's answer at
-- the first hole, if the prefix property failed. One ZMSCORE per CHUNK blocks.
local function verified(r, last)
  local rk = rprefix .. r
  local i = 2
  while i <= last do
    local j = math.min(last, i + CHUNK - 1)
    local members = {}
    for k = i, j do members[k - i + 1] = member(k) end
    local scores = call('ZMSCORE', rk, unpack(members))
    for k = 1, #scores do
      if not scores[k] then return i + k - 2 end
    end
    i = j + 1
  end
  return last
end
local out = {}
local flat = call('HGETALL', KEYS[1])
for j = 1, #flat, 2 do
  local r = flat[j]
  if alive(flat[j + 1]) then
    local run = 1
    if n > 1 then
      if call('EXISTS', tprefix .. r) == 1 then
        run = walk(r)
      else
        run = bisect(r)
        -- Verify where a hole may be: the writers saw one coming (hole flag), or the
        -- run's last link is broken (a chain whose blocks are not the index's chains).
        if call('EXISTS', hprefix .. r) == 1 or (run > 2 and not held(r, run - 1)) then
          run = verified(r, run)
        end
      end
    end
    out[#out + 1] = r
    out[#out + 1] = run
  end
end
return out
