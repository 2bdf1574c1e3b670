-- advance: hand a job from a finished stage to the next one's queue.
-- uses: jobs
-- KEYS: (none)
-- ARGV: job, from_stage, token, to_stage, new_token, queue, node, field, value, message
--   field/value: what the stage leaves the next (hstate or result). message: the next
--   stage's, for new_token (see jobs/messages.py), pushed and recorded on the queue here: the
--   whole hand-off is this one call. '' = the caller publishes; the job stays in the
--   active set under this worker's heartbeat until handed_off runs after the publish, so a
--   crash between the two is caught by the reaper.
-- returns: 'ok' | 'missing' | 'terminal' | 'stale'

local id, from, token, to, new = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local queue, node, field, value, message = ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local jk = K.job(id)
local j = redis.call('HMGET', jk, 'state', 'phase', 'token', 'batch_id', 't_' .. from .. '_start',
                     'backend', 'slot', 'tenant', 'prio_s')
if not j[1] then return 'missing' end
if TERMINAL[j[1]] then return 'terminal' end
if j[1] ~= from or j[3] ~= token or j[2] ~= 'active' then return 'stale' end
local now = now_s()
observe_active(from, j[5], now)
-- No holder until whoever takes the next stage heartbeats it. (Written with its slot of
-- the next queue, or its place in a pen, below.)
local set = {'state', to, 't_' .. from .. '_end', fmt(now), 'stage', to,
  'phase', 'waiting', 'token', new, 'queue', queue, 't_' .. to .. '_queued', fmt(now),
  'node', node, 'holder', '', field, value}
local pushing = message ~= nil and message ~= ''
count_state(j[1], to, j[4], j[8])
-- The slot of the stage it leaves goes to the next job.
fair_release(id, jk, now, {j[7], j[8], j[9], j[4]}, pushing)
release_backend(id, j[6])  -- a backend slot is held within a stage, never across a hand-off
redis.call('SADD', K.QUEUES, queue)
-- Without a message the caller publishes it and records it (handed_off); until then the
-- heartbeat the worker left stands for the job: should the publish never happen, it goes
-- stale and a sweep re-queues the job.
if pushing then
  push_message(queue, id, message, now, set)
else
  redis.call('HSET', jk, unpack(set))
end
return 'ok'
