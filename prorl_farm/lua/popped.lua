-- popped: the jobs whose message has left its queue without the job being claimed (the
-- reaper's lost-message test; worker/broker.py says why this is the one record a delivery
-- needs). A queue is FIFO and its index (K.queued) holds each waiting job at the time of
-- its push, in the same script or transaction as the push: of N indexed jobs with L entries
-- on the list, the N - L oldest have been popped (an entry on the list that is no job's,
-- a stale message, only makes the count smaller). Jobs that share a push time with one that
-- may still be on the list are left for a later look.
-- uses: jobs
-- KEYS: (none)
-- ARGV: limit, queues...
--   limit: the most jobs returned per queue.
-- returns: flat queue, job, token triples: each job popped and still waiting to be claimed

local limit = tonumber(ARGV[1])
local out = {}
for i = 2, #ARGV do
  local queue = ARGV[i]
  local index = K.queued(queue)
  local popped = redis.call('ZCARD', index) - redis.call('LLEN', queue)
  if popped > 0 then
    -- The oldest `take` jobs, and the one after them (if any) for the bound on push time.
    local take = math.min(popped, limit)
    local rows = redis.call('ZRANGE', index, 0, take, 'WITHSCORES')
    local bound = #rows / 2 > take and tonumber(rows[#rows]) or math.huge
    for r = 1, take * 2, 2 do
      if tonumber(rows[r + 1]) >= bound then break end
      local id = rows[r]
      local j = redis.call('HMGET', K.job(id), 'token', 'phase', 'queue')
      if j[2] == 'waiting' and j[3] == queue then
        out[#out + 1] = queue
        out[#out + 1] = id
        out[#out + 1] = j[1]
      end
    end
  end
end
return out
