-- reaper_lead: take or keep the reaper's lease (one process of the farm sweeps at a time),
-- and say whether there is anything to sweep: any job not in a terminal state.
-- KEYS: lease
-- ARGV: me, lease_ms
--   me: the asking process's reaper id.
-- returns: 'work' (it leads, and jobs are under way) | 'idle' (it leads, nothing to sweep) |
--   'follow' (another process leads)

local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
elseif holder then
  return 'follow'
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
local counts = redis.call('HGETALL', K.STATE_COUNTS)
for i = 1, #counts, 2 do
  if not TERMINAL[counts[i]] and tonumber(counts[i + 1]) > 0 then return 'work' end
end
return 'idle'
