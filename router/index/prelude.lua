-- Helpers the write scripts (write.lua, remove.lua, clear.lua) start with: RedisIndex
-- prepends this file to each of them.
--
-- Lua 5.1 prints large numbers in %.14g, which would turn a ms timestamp into "1.7e+12";
-- every number written to Redis goes through fmt().
local function fmt(n) return string.format('%.0f', n) end
-- Arguments per batched ZADD / ZREM: well under what Lua 5.1's unpack can pass (~8,000).
local ARGS_PER_CALL = 2000
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- Drop replica's entry from a block's holders. A block key whose never-expiring entry
-- goes takes the TTL of its latest remaining entry, so it cannot outlive them all.
local function drop_holder(bk, replica)
  local e = redis.call('HGET', bk, replica)
  if not e then return end
  redis.call('HDEL', bk, replica)
  if e ~= '0' then return end
  local latest = 0
  for _, v in ipairs(redis.call('HVALS', bk)) do
    if v == '0' then return end
    local n = tonumber(v)
    if n > latest then latest = n end
  end
  if latest > 0 then redis.call('PEXPIREAT', bk, fmt(latest)) end
end
-- A flag fk of a reverse index rk (NS:{M}:t:R, NS:{M}:h:R) lives exactly as long as rk
-- (gone with it, persisted with it): it stays while an entry that raised it may remain.
local function mirror_expiry(fk, rk)
  local at = redis.call('PEXPIRETIME', rk)
  if at == -2 then
    redis.call('DEL', fk)
  elseif at == -1 then
    redis.call('PERSIST', fk)
  else
    redis.call('PEXPIREAT', fk, at)
  end
end
local function raise_flag(fk, rk, raise)
  if raise then redis.call('SET', fk, '1') end
  if raise or redis.call('EXISTS', fk) == 1 then mirror_expiry(fk, rk) end
end
-- Extend a key's TTL to exp (0 = persist). A new key takes exp; an existing one only
-- grows, so one holder's short TTL never cuts another's entry short.
local function set_expiry(key, existed, exp)
  if exp == 0 then
    redis.call('PERSIST', key)
  elseif existed == 0 then
    redis.call('PEXPIREAT', key, fmt(exp))
  else
    redis.call('PEXPIREAT', key, fmt(exp), 'GT')
  end
end
-- Fencing: a leased indexer's writes carry the fence key and the token its lease was
-- granted with as their last two ARGV ('' and '' when unfenced). Once another indexer
-- takes the lease the fence counter has moved on, and a deposed writer's scripts refuse
-- before writing anything (router/index/lease.py).
local function fenced()
  local fk, token = ARGV[#ARGV - 1], ARGV[#ARGV]
  return fk ~= '' and redis.call('GET', fk) ~= token
end
local FENCED = 'FENCED a newer indexer holds the lease'
