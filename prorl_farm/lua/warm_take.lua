-- warm_take: hand a ready warm sandbox for `key` to a job: the oldest one still within its
-- time is taken off the node's ready list and out of its warm records, once.
-- KEYS: ready, records, stats
--   ready: the node's ready list for the key (K.warm_ready); records: the node's warm
--   records (K.warm); stats: K.WARM_STATS.
-- ARGV: node, now
-- returns: the record's handle and JSON, or nil (none ready: a miss)

local now = tonumber(ARGV[2])
while true do
  local handle = redis.call('RPOP', KEYS[1])
  if not handle then
    redis.call('HINCRBY', KEYS[3], ARGV[1] .. ':miss', 1)
    return nil
  end
  local raw = redis.call('HGET', KEYS[2], handle)
  if raw then
    local rec = cjson.decode(raw)
    if rec.status == 'ready' and tonumber(rec['until']) > now then
      redis.call('HDEL', KEYS[2], handle)
      redis.call('HINCRBY', KEYS[3], ARGV[1] .. ':hit', 1)
      return {handle, raw}
    end
  end
end
