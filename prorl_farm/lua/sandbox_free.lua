-- sandbox_free: give a slot back, only if that sandbox still holds it.
-- KEYS: slots
-- ARGV: slot, sandbox
-- returns: 1 | 0

if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
