-- claim: claim a stage of a job for a worker.
-- uses: jobs
-- KEYS: (none)
-- ARGV: job, stage, token, worker, ttl_s, holder, known...
--   holder: the worker process's presence name, or ''; its heartbeats keep it up to date.
--   known: ids of instance and sampling records the caller holds already (they never
--   change): those are not read.
-- returns: {'ok', CLAIM_FIELDS' values (the last: t_<stage>_start), instance JSON,
--   sampling JSON, instance id, sampling id} | {'missing'} | {'terminal'} | {'stale'} |
--   {'expired'}. The JSON is false where the caller knows that record (or it is gone).
--   'stale': a redelivery of a stage that already ran or runs, or of an earlier attempt.

local id, stage, token, worker, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local holder = ARGV[6]
local known = {}
for i = 7, #ARGV do known[ARGV[i]] = true end
local jk = K.job(id)
-- CLAIM_FIELDS (what the stage gets) and what the claim itself needs, in one read.
local n = #CLAIM_FIELDS
local fields = {unpack(CLAIM_FIELDS)}
for _, f in ipairs({'state', 'stage', 'phase', 'token', 'queue', 't_' .. stage .. '_queued',
                    'instance_id', 'sampling_id', 'tenant'}) do
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
if queued then
  local wait = math.max(0, now - tonumber(queued))
  -- (The dashboard's history takes its waits from this histogram: history_waits.lua.)
  observe('wait:' .. stage, wait)
end
count_state(state, stage, at.batch_id, at.tenant)
redis.call('ZADD', K.ACTIVE, now, id)
unqueue(id, queue)
local function record(key_of, rid)
  if not rid or known[rid] then return false end
  return redis.call('GET', key_of(rid))
end
local inst, sampling = record(K.instance, at.instance_id), record(K.sampling, at.sampling_id)
-- What the stage needs of the job, not all of it: CLAIM_FIELDS, then its start time.
local out = {}
for i = 1, n do out[i] = v[i] end
out[n + 1] = fmt(now)
return {'ok', out, inst, sampling, at.instance_id or false, at.sampling_id or false}
