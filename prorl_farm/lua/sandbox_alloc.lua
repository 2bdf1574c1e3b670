-- sandbox_alloc: take a free sandbox slot (a loopback IP) on a node, and mark the job the
-- sandbox is for as one that has sandboxes (its ``sandboxes`` field, read by every claim:
-- a stage of a job without it skips the look for sandboxes to stop as the job ends).
-- KEYS: slots, started, nodes, job, tenants
--   slots: the node's slot hash (slot -> sandbox); started: the per-node counter hash;
--   nodes: the set of nodes that started any; job: the job's hash, or '' (none); tenants:
--   the node's sandbox -> tenant hash (the job's own tenant field counts the sandbox
--   live).
-- ARGV: cap, sandbox, hint, node
--   cap: the node's slot count; hint: the slot to try first.
-- returns: the slot | -1 (all taken)

local slots, cap, id, hint = KEYS[1], tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
if redis.call('HLEN', slots) >= cap then return -1 end
for i = 0, cap - 1 do
  local s = (hint + i) % cap
  if redis.call('HSETNX', slots, s, id) == 1 then
    redis.call('HINCRBY', KEYS[2], ARGV[4], 1)
    redis.call('SADD', KEYS[3], ARGV[4])
    if KEYS[4] ~= '' and redis.call('EXISTS', KEYS[4]) == 1 then
      redis.call('HSET', KEYS[4], 'sandboxes', 1)
      local tenant = redis.call('HGET', KEYS[4], 'tenant')
      if tenant then
        redis.call('HSET', KEYS[5], id, tenant)
        redis.call('HINCRBY', K.tenant(tenant), 'sandboxes', 1)
      end
    end
    return s
  end
end
return -1
