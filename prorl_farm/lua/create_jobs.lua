-- create_jobs: a submission's jobs, waiting for INIT: their INIT messages pushed and
-- recorded on the queue's index while INIT slots are free and nobody waits for one, else
-- kept in the batch's pen for the pick (lib/fair.lua). Runs inside the submission's MULTI/EXEC (with the instances, the
-- sampling record, the batch and the idempotency writes).
-- uses: jobs
-- KEYS: (none)
-- ARGV: batch, handler, sampling_id, deadline_at, mode, created_at, tenant, prio_s, first,
--   jobs...
--   deadline_at: epoch s or '' (none). tenant: the batch's. prio_s: the jobs' head start
--   in their pens (priority times the aging time). first: the index of this call's
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
-- Free INIT slots these jobs take at once (while one is free no job waits in a pen).
local held_by, shared, reserve, held = fair_held('init', nowf)
local room = shared - held
local pending, pushed, penned = {}, 0, 0
local flow = fair_flow(tenant, prio_s, batch)
local pen = K.pen('init', flow)
-- Pushed and indexed, or kept in the pen, a thousand jobs a command.
local kept, placed, indexed = {}, {}, {}
local function flush()
  if #pending > 0 then
    redis.call('LPUSH', 'init', unpack(pending))
    redis.call('ZADD', queued, unpack(indexed))
  end
  if #kept > 0 then
    redis.call('HSET', K.pen_messages('init'), unpack(kept))
    redis.call('ZADD', pen, unpack(placed))
  end
  pending, kept, placed, indexed = {}, {}, {}, {}
end
for i = 10, #ARGV, 6 do
  local id = ARGV[i]
  local jk = K.job(id)
  local published = ARGV[i + 5] ~= ''
  local takes = published and pushed < room
  redis.call('HSET', jk, 'id', id, 'batch_id', batch, 'handler', handler,
    'instance_id', ARGV[i + 2], 'instance_index', ARGV[i + 3], 'sample_index', ARGV[i + 4],
    'sampling_id', sampling_id, 'state', 'queued', 'stage', 'init', 'phase', 'waiting',
    'token', ARGV[i + 1], 'queue', 'init', 'requeues', 0, 'created_at', created,
    't_init_queued', now, 'deadline_at', deadline_at, 'mode', mode, 'tenant', tenant,
    'prio_s', prio_s, unpack(takes and {'slot', 'init'} or {}))
  if deadline_at ~= '' then redis.call('ZADD', K.DEADLINES, tonumber(deadline_at), id) end
  if not published then
    redis.call('ZADD', K.ACTIVE, nowf, id)
  elseif takes then
    indexed[#indexed + 1] = nowf
    indexed[#indexed + 1] = id
    pending[#pending + 1] = ARGV[i + 5]
    pushed = pushed + 1
  else
    kept[#kept + 1] = id
    kept[#kept + 1] = ARGV[i + 5]
    placed[#placed + 1] = fair_place(nowf, prio_s, first + (i - 10) / 6)
    placed[#placed + 1] = id
    penned = penned + 1
  end
  if #pending == 1000 or #placed == 2000 then flush() end
end
flush()
if pushed > 0 then
  redis.call('HINCRBY', K.held('init'), flow, pushed)
  redis.call('HINCRBY', K.FAIR_GIVEN, 'init:' .. tenant, pushed)
end
if penned > 0 then
  redis.call('SADD', K.pen_flows('init'), flow)
  if held + pushed < shared + reserve and not fair_holds_all(held_by, tenant) then
    fair_pick('init', nowf, penned)
  end
end
return (#ARGV - 9) / 6
