-- sandbox_adopt: a warm sandbox becomes a job's: its record names the job (and attempt),
-- the job's index of sandboxes holds it instead of the warm handle's, the job is marked as
-- one with sandboxes, and the job's tenant (its own field) counts it live (sandbox_alloc.lua).
-- KEYS: records, was, index, job, tenants
--   records: the node's sandbox records; was: the warm handle's index (K.job_sandboxes);
--   index: the job's; job: the job's hash; tenants: the node's sandbox -> tenant hash.
-- ARGV: sandbox, record
--   record: the sandbox's record, naming the job.
-- returns: 1 | 0 (the sandbox is gone)

if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('SREM', KEYS[2], ARGV[1])
redis.call('SADD', KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('HSET', KEYS[4], 'sandboxes', 1)
  local tenant = redis.call('HGET', KEYS[4], 'tenant')
  if tenant and redis.call('HSETNX', KEYS[5], ARGV[1], tenant) == 1 then
    redis.call('HINCRBY', K.tenant(tenant), 'sandboxes', 1)
  end
end
return 1
