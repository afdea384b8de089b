-- Store (or, given '', delete) one replica's stream position: the seq and timestamp of
-- the last KV-event batch whose writes are in the index. Sent last in the batch's
-- pipeline, so a position in Redis implies its batch's writes are there too.
-- KEYS: [1] the position key. ARGV: "seq ts" or '', fence key and token.
if fenced() then return redis.error_reply(FENCED) end
if ARGV[1] == '' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
return 1
