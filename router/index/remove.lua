-- Remove blocks for one replica: `remove` and a remove IndexOp.
-- KEYS: [1] reverse ZSET, [2] touch counter, [3..] block keys.
-- ARGV: replica, block key prefix length, TTL flag, hole flag, fence key and token.
if fenced() then return redis.error_reply(FENCED) end
local rk, ck, replica, plen = KEYS[1], KEYS[2], ARGV[1], tonumber(ARGV[2])
-- The reverse index loses them in a few ZREMs, not one per block (write.lua says why).
local members = {}
for i = 3, #KEYS do
  drop_holder(KEYS[i], replica)
  members[#members + 1] = string.sub(KEYS[i], plen + 1)
  if #members >= ARGS_PER_CALL then
    redis.call('ZREM', rk, unpack(members))
    members = {}
  end
end
if #members > 0 then redis.call('ZREM', rk, unpack(members)) end
-- Whether a removed block had held descendants (a hole) is not known here: verify.
raise_flag(ARGV[4], rk, true)
if redis.call('EXISTS', rk) == 0 then redis.call('DEL', ck, ARGV[3], ARGV[4]) end
return #KEYS - 2
