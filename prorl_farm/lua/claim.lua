-- claim: claim a stage of a job for a worker.
-- uses: jobs
-- KEYS: (none)
-- ARGV: job, stage, token, worker, ttl_s, holder
--   holder: the worker process's presence name, or ''; its heartbeats keep it up to date.
-- returns: {'ok', CLAIM_FIELDS' values (the last: t_<stage>_start), instance JSON,
--   sampling JSON} | {'missing'} | {'terminal'} | {'stale'} | {'expired'}.
--   'stale': a redelivery of a stage that already ran or runs, or of an earlier attempt.

local id, stage, token, worker, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local holder = ARGV[6]
local jk = K.job(id)
-- CLAIM_FIELDS (what the stage gets) and what the claim itself needs, in one read.
local n = #CLAIM_FIELDS
local fields = {unpack(CLAIM_FIELDS)}
for _, f in ipairs({'state', 'stage', 'phase', 'token', 'queue', 't_' .. stage .. '_queued',
                    'instance_id', 'sampling_id'}) do
  fields[#fields + 1] = f
end
local v, at = redis.call('HMGET', jk, unpack(fields)), {}
for i, f in ipairs(fields) do at[f] = v[i] end
local state, cur, phase, tok, queue = at.state, at.stage, at.phase, at.token, at.queue
local queued, deadline = at['t_' .. stage .. '_queued'], at.deadline_at
if not state then return {'missing'} end
if TERMINAL[state] then return {'terminal'} end
if cur ~= stage or tok ~= token or phase ~= 'waiting' then return {'stale'} end
local now = now_s()
if deadline and deadline ~= '' and tonumber(deadline) <= now then
  finish(id, jk, 'failed', 'timeout', 'deadline passed while queued for ' .. stage, ttl, now)
  return {'expired'}
end
redis.call('HSET', jk, 'state', stage, 'phase', 'active', 'worker', worker, 'holder', holder,
           't_' .. stage .. '_start', fmt(now))
if queued then observe('wait:' .. stage, now - tonumber(queued)) end
count_state(state, stage, at.batch_id)
redis.call('ZADD', K.ACTIVE, now, id)
if queue and queued then
  -- Queues are FIFO. t_<stage>_queued was taken before this job's message was pushed, so
  -- every message whose push completed before it (its score in the queue's index below it)
  -- was popped before this one: the reaper uses the newest such time to tell a lost message.
  redis.call('ZADD', K.CLAIMED, 'GT', queued, queue)
end
unqueue(id, queue)
local inst = at.instance_id and redis.call('GET', K.instance(at.instance_id)) or false
local sampling = at.sampling_id and redis.call('GET', K.sampling(at.sampling_id)) or false
-- What the stage needs of the job, not all of it: CLAIM_FIELDS, then its start time.
local out = {}
for i = 1, n do out[i] = v[i] end
out[n + 1] = fmt(now)
return {'ok', out, inst, sampling}
