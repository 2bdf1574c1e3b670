-- sandbox_alloc: take a free sandbox slot (a loopback IP) on a node.
-- KEYS: slots, started, nodes
--   slots: the node's slot hash (slot -> sandbox); started: the per-node counter hash;
--   nodes: the set of nodes that started any.
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
    return s
  end
end
return -1
