-- handed_off: after the publish of each job's message (submit, hand-off, re-queue): record
-- that its push completed (queued:<queue>, for the lost-message check) and drop the
-- heartbeat the previous worker left, unless the next stage already claimed the job.
-- uses: jobs
-- KEYS: (none)
-- ARGV: pairs...
--   pairs: job, token, job, token, ...
-- returns: 1

local now = now_s()
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local j = redis.call('HMGET', K.job(id), 'token', 'phase', 'queue')
  if j[1] == ARGV[i + 1] and j[2] == 'waiting' then
    redis.call('ZREM', K.ACTIVE, id)
    redis.call('ZADD', K.queued(j[3]), now, id)
  end
end
return 1
