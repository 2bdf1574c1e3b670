-- backend_update: update a backend's fields, then put it in its tenant's heap at its
-- current load if it is healthy, not drained and its weights passed their check (no
-- weights_error), else take it out.
-- uses: backends
-- KEYS: (none)
-- ARGV: backend, fields...
--   fields: field, value, ...
-- returns: 1 (in the heap) | 0 (out of it) | -1 (no such backend: nothing written) | -2 (a
--   lower policy_version: nothing written)

local b = ARGV[1]
local bk = K.backend(b)
if redis.call('EXISTS', bk) == 0 then
  redis.call('ZREM', K.BACKEND_HEAP, b)
  return -1
end
for i = 2, #ARGV, 2 do
  if ARGV[i] == 'policy_version' and
      tonumber(ARGV[i + 1]) < (tonumber(redis.call('HGET', bk, 'policy_version')) or 0) then
    return -2  -- a policy version only grows: nothing changed
  end
end
for i = 2, #ARGV, 2 do redis.call('HSET', bk, ARGV[i], ARGV[i + 1]) end
local h = redis.call('HMGET', bk, 'healthy', 'drained', 'weights_error')
local heap = heap_of(b)  -- its tenant's
if h[1] ~= '1' or h[2] == '1' or (h[3] and h[3] ~= '') then
  redis.call('ZREM', heap, b)
  return 0
end
local n = tonumber(redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0')
redis.call('ZADD', heap, heap_score(b, n), b)
return 1
