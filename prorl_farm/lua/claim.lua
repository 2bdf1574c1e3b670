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
local j = redis.call('HMGET', jk, 'state', 'stage', 'phase', 'token', 'deadline_at', 'batch_id',
                     'queue', 't_' .. stage .. '_queued', 'instance_id', 'sampling_id')
if not j[1] then return {'missing'} end
if TERMINAL[j[1]] then return {'terminal'} end
if j[2] ~= stage or j[4] ~= token or j[3] ~= 'waiting' then return {'stale'} end
local now = now_s()
if j[5] and j[5] ~= '' and tonumber(j[5]) <= now then
  finish(id, jk, 'failed', 'timeout', 'deadline passed while queued for ' .. stage, ttl, now)
  return {'expired'}
end
redis.call('HSET', jk, 'phase', 'active', 'worker', worker, 't_' .. stage .. '_start', fmt(now))
if holder and holder ~= '' then redis.call('HSET', jk, 'holder', holder) end
if j[8] then observe('wait:' .. stage, now - tonumber(j[8])) end
set_state(jk, j[1], stage, j[6])
redis.call('ZADD', K.ACTIVE, now, id)
if j[7] and j[8] then
  -- Queues are FIFO. t_<stage>_queued was taken before this job's message was pushed, so
  -- every message whose push completed before it (published score below it) was popped
  -- before this one: the reaper uses the newest such time to tell a lost message.
  local last = redis.call('HGET', K.CLAIMED, j[7])
  if not last or tonumber(j[8]) > tonumber(last) then
    redis.call('HSET', K.CLAIMED, j[7], j[8])
  end
end
unqueue(id, j[7])
local inst = j[9] and redis.call('GET', K.instance(j[9])) or false
local sampling = j[10] and redis.call('GET', K.sampling(j[10])) or false
-- What the stage needs of the job, not all of it: CLAIM_FIELDS, then its start time.
local fields = {unpack(CLAIM_FIELDS)}
fields[#fields + 1] = 't_' .. stage .. '_start'
return {'ok', redis.call('HMGET', jk, unpack(fields)), inst, sampling}
