-- The indexer lease (router/index/lease.py): one active indexer per namespace.
-- KEYS: [1] lease key, [2] fence counter.
-- ARGV: action ('acquire', 'renew' or 'release'), holder, token (renew, release), ttl_ms.
-- The lease's value is "token holder". Acquiring increments the fence counter, so the
-- new token fences out every write of the previous holder (prelude.lua's fenced()).
local action, holder, token, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local current = redis.call('GET', KEYS[1])
if action == 'acquire' then
  if current then return false end
  local granted = redis.call('INCR', KEYS[2])
  redis.call('SET', KEYS[1], granted .. ' ' .. holder, 'PX', ttl)
  return granted
end
local mine = current == token .. ' ' .. holder and redis.call('GET', KEYS[2]) == token
if not mine then return 0 end
if action == 'renew' then
  redis.call('PEXPIRE', KEYS[1], ttl)
else
  redis.call('DEL', KEYS[1])
end
return 1
