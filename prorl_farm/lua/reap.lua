-- reap: recover a job whose worker died or whose message was lost. Idempotent: it acts
-- only if the job still carries the token the caller saw, so overlapping sweeps cannot reap
-- one attempt twice.
-- uses: jobs
-- KEYS: (none)
-- ARGV: job, mode, cutoff, expect_token, queue, max_requeues, new_token, ttl_s, reason,
--   max_history, message
--   mode: 'active' (stale heartbeat), 'queued' (waiting on a dead node's queue), 'orphan'
--   (its message was reserved by a dead worker), 'lost' (its message left the queue
--   unclaimed), 'leave' (its node is being stopped: re-queued at once, whatever its phase,
--   without counting against max_requeues: the job did nothing wrong). cutoff: epoch s, a
--   heartbeat older than this is dead. queue: '' for 'active'; for 'leave', the leaving
--   pool's. message: the new INIT message for new_token ('' = the caller publishes it,
--   then calls handed_off).
-- returns: 'alive' | 'gone' | 'moved' | 'requeue' | 'failed'

local id, mode, cutoff, expect, queue = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local maxrq, new, ttl, msg = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8]), ARGV[9]
local keep, message = tonumber(ARGV[10]), ARGV[11]
local jk = K.job(id)
local j = redis.call('HMGET', jk, 'state', 'phase', 'queue', 'requeues', 'batch_id', 'stage',
                     'token', 'node', 'attempts', 'slot', 'tenant', 'prio_s')
if not j[1] or TERMINAL[j[1]] then
  redis.call('ZREM', K.ACTIVE, id)
  unqueue(id, queue)
  return 'gone'
end
if j[7] ~= expect then return 'moved' end
local beat = redis.call('ZSCORE', K.ACTIVE, id)
if beat and tonumber(beat) >= cutoff then return 'alive' end
if mode == 'active' then
  if not beat then return 'moved' end
elseif mode == 'leave' then
  -- Only a job of the leaving pool's own queue: one that has gone on to another node's
  -- (its token read a moment before this call) is not this pool's to hand back.
  if j[2] == 'end' or j[3] ~= queue then return 'moved' end
elseif j[2] ~= 'waiting' or (mode ~= 'orphan' and j[3] ~= queue) then
  return 'moved'
end
local now = now_s()
signal_holder(jk)
local n = tonumber(j[4] or '0')
if n >= maxrq and mode ~= 'leave' then
  finish(id, jk, 'failed', 'worker_lost', msg, ttl, now)
  redis.call('HINCRBY', K.REAPER_ACTIONS, mode .. ':failed', 1)
  return 'failed'
end
redis.call('HINCRBY', K.REAPER_ACTIONS, mode .. ':requeue', 1)
-- A clean attempt: nothing of the last one but the count and a line of history.
local history = j[9] and cjson.decode(j[9]) or {}
table.insert(history, {attempt = n, stage = j[6], node = j[8] or cjson.null, reason = msg,
                       at = tonumber(fmt(now))})
while #history > keep do table.remove(history, 1) end
unqueue(id, j[3])
-- (With a message the job enters INIT's queue below, which sets or drops its slot field.)
fair_release(id, jk, now, {j[10], j[11], j[12], j[5]}, message ~= nil and message ~= '')
redis.call('HDEL', jk, unpack(ATTEMPT_FIELDS))
redis.call('HSET', jk, 'state', 'queued', 'stage', 'init', 'phase', 'waiting', 'token', new,
  'queue', 'init', 'requeues', mode == 'leave' and n or n + 1, 't_init_queued', fmt(now),
  'attempts', cjson.encode(history))
count_state(j[1], 'queued', j[5], j[11])
release_backend(id)
if message and message ~= '' then
  push_message('init', id, message, now)
else
  -- A fresh heartbeat until the caller has published the new INIT message (HANDED_OFF
  -- drops it): should the publish fail, the job goes stale again and a sweep finds it.
  redis.call('ZADD', K.ACTIVE, now, id)
end
return 'requeue'
