-- engine_claim: the engines a backend's URL reaches are its tenant's: claim them for it (all
-- or none), or let go of a backend's claim (the last backend of an engine frees it).
-- KEYS: (none)
-- ARGV: mode, tenant, endpoints...
--   mode: 'claim' or 'release'. endpoints: the URL's normalised endpoints
--   (access.engine_endpoints: "<address>:<port>", "local:<port>").
-- returns: 1 | 0 (claim: an endpoint is another tenant's; nothing was claimed)

local mode, tenant = ARGV[1], ARGV[2]
if mode == 'claim' then
  for i = 3, #ARGV do
    local owner = redis.call('HGET', K.ENGINES, ARGV[i])
    if owner and owner ~= tenant then return 0 end
  end
  for i = 3, #ARGV do
    redis.call('HSET', K.ENGINES, ARGV[i], tenant)
    redis.call('HINCRBY', K.ENGINE_REFS, ARGV[i], 1)
  end
  return 1
end
for i = 3, #ARGV do
  if redis.call('HINCRBY', K.ENGINE_REFS, ARGV[i], -1) <= 0 then
    redis.call('HDEL', K.ENGINE_REFS, ARGV[i])
    redis.call('HDEL', K.ENGINES, ARGV[i])
  end
end
return 1
