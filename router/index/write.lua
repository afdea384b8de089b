-- Add a chain of blocks for one replica: `add`, `record` and an add IndexOp.
-- KEYS: [1] reverse ZSET, [2] touch counter, [3..] block keys in chain order.
-- ARGV: replica, ttl_ms (0 = never), capacity (0 = unbounded), block key prefix, TTL flag,
-- hole flag, the key of the first block's parent ('' for a chain root, or unknown),
-- how many expired entries to sweep from the reverse index's head, then the fence
-- key and token (prelude.lua).
if fenced() then return redis.error_reply(FENCED) end
local rk, ck = KEYS[1], KEYS[2]
local replica, ttl, cap, bprefix = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local tk, hk, pk = ARGV[5], ARGV[6], ARGV[7]
local sweep = tonumber(ARGV[8])
-- A block whose parent the replica does not hold (its store event was lost, or came
-- before we subscribed and out of the replay) starts a run behind a hole.
local orphan = false
if pk ~= '' then
  local e = redis.call('HGET', pk, replica)
  orphan = not (e and (e == '0' or tonumber(e) > now_ms()))
end
local plen = string.len(bprefix)
local now = now_ms()
local exp = 0
if ttl > 0 then exp = now + ttl end
local n = #KEYS - 2
local r_existed = redis.call('EXISTS', rk)
local c_existed = redis.call('EXISTS', ck)
local base = redis.call('INCRBY', ck, n)
local entry = fmt(exp)
-- Tail first and block 0 last, with the highest score: trimming takes tails first, and a
-- key repeated within the chain ends up where its first occurrence puts it (ZADD applies
-- its pairs in order). The reverse index takes them in a few ZADDs, not one per block:
-- each redis.call costs as much as the work of a small one (bench_index_writes.py).
local scored = {}
for i = #KEYS, 3, -1 do
  local bk = KEYS[i]
  if exp == 0 then
    -- Never expiring: whether the key existed does not matter (set_expiry persists it).
    redis.call('HSET', bk, replica, entry)
    redis.call('PERSIST', bk)
  else
    local existed = redis.call('EXISTS', bk)
    redis.call('HSET', bk, replica, entry)
    set_expiry(bk, existed, exp)
  end
  scored[#scored + 1] = fmt(base - (i - 3))
  scored[#scored + 1] = string.sub(bk, plen + 1)
  if #scored >= ARGS_PER_CALL then
    redis.call('ZADD', rk, unpack(scored))
    scored = {}
  end
end
if #scored > 0 then redis.call('ZADD', rk, unpack(scored)) end
set_expiry(rk, r_existed, exp)
set_expiry(ck, c_existed, exp)
if cap > 0 then
  local over = redis.call('ZCARD', rk) - cap
  if over > 0 then
    local victims = redis.call('ZPOPMIN', rk, over)
    for j = 1, #victims, 2 do
      drop_holder(bprefix .. victims[j], replica)
    end
  end
end
local head = redis.call('ZRANGE', rk, 0, sweep - 1)
for _, m in ipairs(head) do
  local e = redis.call('HGET', bprefix .. m, replica)
  if e and (e == '0' or tonumber(e) > now) then break end
  redis.call('ZREM', rk, m)
  if e then redis.call('HDEL', bprefix .. m, replica) end
end
raise_flag(tk, rk, exp > 0)
raise_flag(hk, rk, orphan)
return n
