-- create_jobs: a submission's jobs, waiting for INIT: their INIT messages pushed and
-- recorded on the queue's index while INIT slots are free and nobody waits for one, else
-- kept in the tenant's pen for the pick (lib/fair.lua). Runs inside the submission's MULTI/EXEC (with the instances, the
-- sampling record, the batch and the idempotency writes).
-- uses: jobs
-- KEYS: (none)
-- ARGV: batch, handler, sampling_id, deadline_at, mode, created_at, tenant, prio_s, first,
--   jobs...
--   deadline_at: epoch s or '' (none). tenant: the batch's. prio_s: the jobs' head start
--   in their tenant's pens (priority times the aging time). first: the index of this call's
--   first job in the submission (their places in a pen keep the submission's order). jobs: per job, six values: id, token, instance id,
--   instance index, sample index, INIT message ('' = the caller publishes it, then records
--   it with handed_off; until then a heartbeat stands for the job).
-- returns: the number of jobs written

local batch, handler, sampling_id, deadline_at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local mode, created, tenant, prio_s = ARGV[5], ARGV[6], ARGV[7], tonumber(ARGV[8]) or 0
local first = tonumber(ARGV[9])
-- Queued at the time of the push itself, not of the request: submissions
-- running side by side push in an order their request times need not follow, and the
-- reaper's FIFO test (CLAIM) relies on the order of these times being the push order.
local nowf = now_s()
local now = fmt(nowf)
local queued = K.queued('init')
-- Free INIT slots these jobs take at once (none while jobs wait in a pen: the pick decides).
local room = 0
if redis.call('EXISTS', K.pen_tenants('init')) == 0 then
  local shared, _, held = fair_slots('init', nowf)
  room = shared - held
end
local pending, pushed, penned = {}, 0, 0
local pen = K.pen('init', tenant)
for i = 10, #ARGV, 6 do
  local id = ARGV[i]
  local jk = K.job(id)
  redis.call('HSET', jk, 'id', id, 'batch_id', batch, 'handler', handler,
    'instance_id', ARGV[i + 2], 'instance_index', ARGV[i + 3], 'sample_index', ARGV[i + 4],
    'sampling_id', sampling_id, 'state', 'queued', 'stage', 'init', 'phase', 'waiting',
    'token', ARGV[i + 1], 'queue', 'init', 'requeues', 0, 'created_at', created,
    't_init_queued', now, 'deadline_at', deadline_at, 'mode', mode, 'tenant', tenant,
    'prio_s', prio_s)
  if deadline_at ~= '' then redis.call('ZADD', K.DEADLINES, tonumber(deadline_at), id) end
  if ARGV[i + 5] == '' then
    redis.call('ZADD', K.ACTIVE, nowf, id)
  elseif pushed < room then
    redis.call('ZADD', queued, nowf, id)
    redis.call('HSET', jk, 'slot', 'init')
    pending[#pending + 1] = ARGV[i + 5]
    pushed = pushed + 1
  else
    redis.call('HSET', K.pen_messages('init'), id, ARGV[i + 5])
    redis.call('ZADD', pen, fair_place(nowf, prio_s, first + (i - 10) / 6), id)
    penned = penned + 1
  end
  if #pending == 1000 then
    redis.call('LPUSH', 'init', unpack(pending))
    pending = {}
  end
end
if #pending > 0 then redis.call('LPUSH', 'init', unpack(pending)) end
if pushed > 0 then
  redis.call('HINCRBY', K.held('init'), tenant, pushed)
  redis.call('HINCRBY', K.held('init'), '*', pushed)
  redis.call('HINCRBY', K.FAIR_GIVEN, 'init:' .. tenant, pushed)
end
if penned > 0 then
  redis.call('SADD', K.pen_tenants('init'), tenant)
  fair_pick('init', nowf, penned)
end
return (#ARGV - 9) / 6
