-- restore_message: push a delivered, unacked stage message back onto its queue (a worker
-- shutting down with it reserved, or a rejection with requeue), and move its job's entry in
-- the queue's index to this push, if the job still waits there: the index stays in push
-- order, as the reaper's lost-message test (popped.lua) needs.
-- uses: jobs
-- KEYS: (none)
-- ARGV: queue, job, message
-- returns: 1

local queue, id, message = ARGV[1], ARGV[2], ARGV[3]
redis.call('LPUSH', queue, message)
redis.call('ZADD', K.queued(queue), 'XX', now_s(), id)
return 1
