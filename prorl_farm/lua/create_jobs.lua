-- create_jobs: a submission's jobs, waiting for INIT, their INIT messages pushed and
-- recorded on the queue's index. Runs inside the submission's MULTI/EXEC (with the instances, the
-- sampling record, the batch and the idempotency writes).
-- uses: jobs
-- KEYS: (none)
-- ARGV: batch, handler, sampling_id, deadline_at, mode, created_at, jobs...
--   deadline_at: epoch s or '' (none). jobs: per job, six values: id, token, instance id,
--   instance index, sample index, INIT message ('' = the caller publishes it, then records
--   it with handed_off; until then a heartbeat stands for the job).
-- returns: the number of jobs written

local batch, handler, sampling_id, deadline_at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local mode, created = ARGV[5], ARGV[6]
-- Queued at the time of the push itself, not of the request: submissions
-- running side by side push in an order their request times need not follow, and the
-- reaper's FIFO test (CLAIM) relies on the order of these times being the push order.
local nowf = now_s()
local now = fmt(nowf)
local queued = K.queued('init')
local pending = {}
for i = 7, #ARGV, 6 do
  local id = ARGV[i]
  redis.call('HSET', K.job(id), 'id', id, 'batch_id', batch, 'handler', handler,
    'instance_id', ARGV[i + 2], 'instance_index', ARGV[i + 3], 'sample_index', ARGV[i + 4],
    'sampling_id', sampling_id, 'state', 'queued', 'stage', 'init', 'phase', 'waiting',
    'token', ARGV[i + 1], 'queue', 'init', 'requeues', 0, 'created_at', created,
    't_init_queued', now, 'deadline_at', deadline_at, 'mode', mode)
  if deadline_at ~= '' then redis.call('ZADD', K.DEADLINES, tonumber(deadline_at), id) end
  if ARGV[i + 5] ~= '' then
    redis.call('ZADD', queued, nowf, id)
    pending[#pending + 1] = ARGV[i + 5]
  else
    redis.call('ZADD', K.ACTIVE, nowf, id)
  end
  if #pending == 1000 then
    redis.call('LPUSH', 'init', unpack(pending))
    pending = {}
  end
end
if #pending > 0 then redis.call('LPUSH', 'init', unpack(pending)) end
return (#ARGV - 6) / 6
