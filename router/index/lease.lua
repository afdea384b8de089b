-- The indexer lease (router/index/lease.py): one active indexer per namespace.
-- KEYS: [1] lease key, [2] fence counter.
-- ARGV: action ('acquire', 'renew' or 'release'), holder, token (renew, release), ttl_ms.
-- The lease's value is "token holder". Acquiring moves the fence counter up, so the
-- new token fences out every write of the previous holder (prelude.lua's fenced()).
local action, holder, token, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local current = redis.call('GET', KEYS[1])
if action == 'acquire' then
  if current then return false end
  -- Never below this server's clock in microseconds (2^53 is centuries away): a
  -- promoted replica that missed the counter (asynchronous replication) still grants a
  -- token above every one granted before the failover, as long as the two servers'
  -- clocks agree to within the time between the grants.
  local t = redis.call('TIME')
  local clock = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local granted = string.format('%.0f', math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, clock))
  redis.call('SET', KEYS[2], granted)
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
