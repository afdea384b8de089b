-- Drop up to `chunk` of one replica's entries in one model scope (clear_replica).
-- KEYS: [1] reverse ZSET, [2] touch counter.
-- ARGV: replica, block key prefix, chunk, TTL flag, hole flag, fence key and token.
-- Returns how many entries are left, so the client calls again until 0.
if fenced() then return redis.error_reply(FENCED) end
local rk, ck = KEYS[1], KEYS[2]
local replica, bprefix, chunk = ARGV[1], ARGV[2], tonumber(ARGV[3])
local members = redis.call('ZRANGE', rk, 0, chunk - 1)
for _, m in ipairs(members) do
  drop_holder(bprefix .. m, replica)
end
redis.call('ZREMRANGEBYRANK', rk, 0, chunk - 1)
local left = redis.call('ZCARD', rk)
if left == 0 then redis.call('DEL', ck, ARGV[4], ARGV[5]) end
return left
