-- sandbox_free: give a slot back, only if that sandbox still holds it (and its tenant's
-- count of live sandboxes with it).
-- KEYS: slots, tenants
--   tenants: the node's sandbox -> tenant hash (sandbox_alloc.lua).
-- ARGV: slot, sandbox
-- returns: 1 | 0

if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  local tenant = redis.call('HGET', KEYS[2], ARGV[2])
  if tenant then
    redis.call('HDEL', KEYS[2], ARGV[2])
    redis.call('HINCRBY', K.tenant(tenant), 'sandboxes', -1)
  end
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
