-- expire_deadlines: fail every non-terminal job whose deadline has passed; a job a stage
-- is running gets grace_s more, for its stage to stop by itself first (its pool ends it
-- otherwise).
-- uses: jobs
-- KEYS: (none)
-- ARGV: ttl_s, limit, grace_s
-- returns: the number of jobs failed

local ttl, limit, grace = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3] or '0')
local now = now_s()
local rows = redis.call('ZRANGEBYSCORE', K.DEADLINES, '-inf', now, 'WITHSCORES', 'LIMIT', 0,
                        limit)
local n = 0
for i = 1, #rows, 2 do
  local id, at = rows[i], tonumber(rows[i + 1])
  local jk = K.job(id)
  local j = redis.call('HMGET', jk, 'state', 'phase')
  local state = j[1]
  if state and not TERMINAL[state] and j[2] == 'active' and at + grace > now then
    -- running: its stage stops by itself within the grace, or its pool ends it
  elseif state and not TERMINAL[state] then
    signal_holder(jk)
    finish(id, jk, 'failed', 'timeout', 'job deadline passed', ttl, now)
    redis.call('HINCRBY', K.REAPER_ACTIONS, 'deadline:failed', 1)
    n = n + 1
  else
    redis.call('ZREM', K.DEADLINES, id)
  end
end
return n
