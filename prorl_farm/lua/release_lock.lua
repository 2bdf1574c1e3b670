-- release_lock: release a lock only if this holder still holds it.
-- KEYS: lock
-- ARGV: value
-- returns: 1 (released) | 0

if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
