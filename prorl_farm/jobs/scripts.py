"""Lua scripts for atomic job transitions.

Keys come from the table ``K`` (:data:`prorl_farm.keys.LUA`); a script builds per-job keys
from the job id and reads the job's batch and queue from its hash (the farm targets a
single Redis, not Redis Cluster). Times come from Redis ``TIME`` so that timings agree
across nodes whatever their clocks say. Outcome strings are the values of the enums in
:mod:`prorl_farm.jobs.states`.

Job hash fields: ``id batch_id handler instance_id instance_index sample_index sampling_id
state stage phase token queue node worker holder requeues attempts created_at deadline_at
finished_at failure_kind failure_message hstate result reward`` and
``t_<stage>_{queued,start,end}``.
"""

from prorl_farm import keys
from prorl_farm.config import STAGES
from prorl_farm.llm.scripts import RELEASE_FN
from prorl_farm.metrics import LUA_OBSERVE

# Fields that belong to one attempt: a re-queued job starts again without them.
ATTEMPT_FIELDS = ["hstate", "result", "node", "worker", "holder", "reward"] + [
    f"t_{stage}_{k}" for stage in STAGES for k in ("queued", "start", "end")]
# Earlier attempts' failures kept in a re-queued job's ``attempts`` (the newest).
MAX_ATTEMPT_HISTORY = 5

PRELUDE = keys.LUA + RELEASE_FN + LUA_OBSERVE + r"""
local TERMINAL = {done = true, failed = true, cancelled = true}
local ATTEMPT_FIELDS = {""" + ", ".join(f"'{f}'" for f in ATTEMPT_FIELDS) + r"""}
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end

-- Move a job to another state, keeping its batch's per-state counters exact.
local function set_state(jk, old, new, batch)
  if old == new then return end
  redis.call('HSET', jk, 'state', new)
  local ck = K.batch_counts(batch)
  redis.call('HINCRBY', ck, old, -1)
  redis.call('HINCRBY', ck, new, 1)
  redis.call('HINCRBY', K.STATE_COUNTS, old, -1)
  redis.call('HINCRBY', K.STATE_COUNTS, new, 1)
end

-- A stage's active time, from its start field, into the stage's histogram.
local function observe_active(jk, stage, now)
  local start = redis.call('HGET', jk, 't_' .. stage .. '_start')
  if start then observe('active:' .. stage, now - tonumber(start)) end
end

-- A stage message pushed by the script that moved its job: on its queue, recorded as
-- published (for the reaper's lost-message test), and no heartbeat left to go stale.
local function push_message(queue, id, message, now)
  redis.call('LPUSH', queue, message)
  redis.call('ZREM', K.ACTIVE, id)
  redis.call('ZADD', K.published(queue), now, id)
end

-- Drop a job from the indexes of the queue it waits on.
local function unqueue(id, queue)
  if queue and queue ~= '' then
    redis.call('ZREM', K.queued(queue), id)
    redis.call('ZREM', K.published(queue), id)
  end
end

-- The one way into a terminal state. Returns "<old state>:<old phase>:<old token>".
local function finish(id, jk, state, kind, msg, ttl, now)
  local j = redis.call('HMGET', jk, 'state', 'stage', 'phase', 'batch_id', 'queue', 'token',
                       'instance_id', 'sampling_id')
  local old, stage, phase, batch, queue, token, inst = j[1], j[2], j[3], j[4], j[5], j[6], j[7]
  if phase == 'active' then
    redis.call('HSET', jk, 't_' .. stage .. '_end', fmt(now))
    observe_active(jk, stage, now)
  end
  redis.call('HSET', jk, 'phase', 'end', 'finished_at', fmt(now))
  if kind ~= '' then
    redis.call('HSET', jk, 'failure_kind', kind, 'failure_message', msg)
    if state == 'failed' then redis.call('HINCRBY', K.FAILURE_KINDS, kind, 1) end
  end
  set_state(jk, old, state, batch)
  release_backend(id)
  redis.call('XADD', K.batch_stream(batch), '*', 'job', id, 'state', state)
  redis.call('ZREM', K.ACTIVE, id)
  redis.call('ZREM', K.DEADLINES, id)
  unqueue(id, queue)
  redis.call('HINCRBY', K.STATS, state, 1)
  redis.call('EXPIRE', jk, ttl)
  if inst then redis.call('EXPIRE', K.instance(inst), ttl) end
  if j[8] then redis.call('EXPIRE', K.sampling(j[8]), ttl) end
  for _, k in ipairs({K.batch(batch), K.batch_counts(batch), K.batch_stream(batch),
                      K.batch_jobs(batch)}) do
    redis.call('EXPIRE', k, ttl)
  end
  return old .. ':' .. phase .. ':' .. (token or '')
end
"""

# Claim a stage for a worker. ARGV: job, stage, token, worker, ttl_s, holder (the worker
# process's presence name, or ''; its heartbeats keep it up to date from then on).
# Returns {"ok", <the job fields a stage needs>, <instance JSON>, <sampling JSON>} | {"missing"} | {"terminal"} |
# {"stale"} | {"expired"}. "stale": a redelivery of a stage that already ran or runs, or of an
# earlier attempt.
CLAIM = r"""
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
-- What the stage needs of the job (store.CLAIM_FIELDS, in that order), not all of it.
return {'ok', redis.call('HMGET', jk, 'id', 'batch_id', 'handler', 'instance_index',
                         'sample_index', 'requeues', 'mode', 'hstate', 'result', 'deadline_at',
                         't_' .. stage .. '_start'), inst, sampling}
"""

# Hand a job from a finished stage to the next one's queue.
# ARGV: job, from_stage, token, to_stage, new_token, queue, node, field, value, message.
# With a message (the next stage's, for new_token; see jobs/messages.py) the script pushes
# it and records it published: the whole hand-off is this one call. Without ('') the
# caller publishes, and the job stays in the active set under this worker's heartbeat until
# HANDED_OFF runs after the publish, so a crash between the two is caught by the reaper.
ADVANCE = r"""
local id, from, token, to, new = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local queue, node, field, value, message = ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local jk = K.job(id)
local j = redis.call('HMGET', jk, 'state', 'phase', 'token', 'batch_id')
if not j[1] then return 'missing' end
if TERMINAL[j[1]] then return 'terminal' end
if j[1] ~= from or j[3] ~= token or j[2] ~= 'active' then return 'stale' end
local now = now_s()
observe_active(jk, from, now)
redis.call('HSET', jk, 't_' .. from .. '_end', fmt(now), 'stage', to, 'phase', 'waiting',
  'token', new, 'queue', queue, 't_' .. to .. '_queued', fmt(now), 'node', node, field, value)
redis.call('HDEL', jk, 'holder')  -- whoever takes the next stage heartbeats it
set_state(jk, j[1], to, j[4])
release_backend(id)  -- a backend slot is held within a stage, never across a hand-off
redis.call('ZADD', K.queued(queue), now, id)
redis.call('SADD', K.QUEUES, queue)
if message and message ~= '' then push_message(queue, id, message, now) end
return 'ok'
"""

# Submission: the jobs of one request, waiting for INIT, with their INIT messages pushed and
# recorded as published. Run inside the submission's MULTI/EXEC (with the instances, batch
# and idempotency writes). ARGV: batch, handler, sampling id, deadline_at ('' = none),
# mode, created_at, then per job: id, token, instance id, instance index, sample index,
# message ('' = none: the caller publishes it and then records it with HANDED_OFF).
CREATE_JOBS = r"""
local batch, handler, sampling_id, deadline_at = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local mode, created = ARGV[5], ARGV[6]
-- Queued and published at the time of the push itself, not of the request: submissions
-- running side by side push in an order their request times need not follow, and the
-- reaper's FIFO test (CLAIM) relies on the order of these times being the push order.
local nowf = now_s()
local now = fmt(nowf)
local queued, published = K.queued('init'), K.published('init')
local pending = {}
for i = 7, #ARGV, 6 do
  local id = ARGV[i]
  redis.call('HSET', K.job(id), 'id', id, 'batch_id', batch, 'handler', handler,
    'instance_id', ARGV[i + 2], 'instance_index', ARGV[i + 3], 'sample_index', ARGV[i + 4],
    'sampling_id', sampling_id, 'state', 'queued', 'stage', 'init', 'phase', 'waiting',
    'token', ARGV[i + 1], 'queue', 'init', 'requeues', 0, 'created_at', created,
    't_init_queued', now, 'deadline_at', deadline_at, 'mode', mode)
  redis.call('ZADD', queued, nowf, id)
  if deadline_at ~= '' then redis.call('ZADD', K.DEADLINES, tonumber(deadline_at), id) end
  if ARGV[i + 5] ~= '' then
    redis.call('ZADD', published, nowf, id)
    pending[#pending + 1] = ARGV[i + 5]
  end
  if #pending == 1000 then
    redis.call('LPUSH', 'init', unpack(pending))
    pending = {}
  end
end
if #pending > 0 then redis.call('LPUSH', 'init', unpack(pending)) end
return (#ARGV - 6) / 6
"""

# After the publish of each job's message (submit, hand-off, re-queue): record that its push
# completed (published:<queue>, for the lost-message check) and drop the heartbeat the
# previous worker left, unless the next stage already claimed the job.
# ARGV: job/token pairs.
HANDED_OFF = r"""
local now = now_s()
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local j = redis.call('HMGET', K.job(id), 'token', 'phase', 'queue')
  if j[1] == ARGV[i + 1] and j[2] == 'waiting' then
    redis.call('ZREM', K.ACTIVE, id)
    redis.call('ZADD', K.published(j[3]), now, id)
  end
end
return 1
"""

# Terminal transition. ARGV: job, token ('' = any), state, kind, message, ttl_s,
# then field/value pairs to set. Returns "ok:<old state>:<old phase>:<old token>",
# "terminal:<state>", "stale" or "missing".
FINISH = r"""
local id, token, state, kind, msg, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local jk = K.job(id)
local j = redis.call('HMGET', jk, 'state', 'token', 'phase')
if not j[1] then return 'missing' end
if TERMINAL[j[1]] then return 'terminal:' .. j[1] end
if token ~= '' and (j[2] ~= token or j[3] ~= 'active') then return 'stale' end
for i = 7, #ARGV, 2 do redis.call('HSET', jk, ARGV[i], ARGV[i + 1]) end
return 'ok:' .. finish(id, jk, state, kind, msg, ttl, now_s())
"""

# Refresh the heartbeat of jobs a worker holds (reserved or running), and record which
# process holds each (``holder``: its presence name, see worker/liveness.py).
# ARGV: holder, then job/token pairs. Returns the flat job/token pairs the worker must
# abort: the job is gone, terminal, or has moved on to another attempt.
HEARTBEAT = r"""
local now = now_s()
local holder = ARGV[1]
local abort = {}
for i = 2, #ARGV, 2 do
  local id, tok = ARGV[i], ARGV[i + 1]
  local jk = K.job(id)
  local j = redis.call('HMGET', jk, 'state', 'token', 'holder')
  if j[1] and not TERMINAL[j[1]] and j[2] == tok then
    redis.call('ZADD', K.ACTIVE, now, id)
    if j[3] ~= holder then redis.call('HSET', jk, 'holder', holder) end
  else
    abort[#abort + 1] = id
    abort[#abort + 1] = tok
  end
end
return abort
"""

# Recover a job whose worker died or whose message was lost. Idempotent: it acts only if
# the job still carries the token the caller saw, so overlapping sweeps cannot reap one
# attempt twice.
# ARGV: job, mode, cutoff (epoch s: a heartbeat older than this is dead), expected token,
# queue ('' for mode 'active'), max_requeues, new_token, ttl_s, message, max history, and
# the new INIT message for new_token ('' = the caller publishes it, then calls HANDED_OFF).
# Modes: 'active' (stale heartbeat), 'queued' (waiting on a dead node's queue), 'orphan'
# (its message was reserved by a dead worker), 'lost' (its message left the queue unclaimed),
# 'leave' (its node is being stopped: re-queued at once, whatever its phase, without
# counting against max_requeues: the job did nothing wrong).
# Returns 'alive' | 'gone' | 'moved' | 'requeue' | 'failed'.
REAP = r"""
local id, mode, cutoff, expect, queue = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5]
local maxrq, new, ttl, msg = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8]), ARGV[9]
local keep, message = tonumber(ARGV[10]), ARGV[11]
local jk = K.job(id)
local j = redis.call('HMGET', jk, 'state', 'phase', 'queue', 'requeues', 'batch_id', 'stage',
                     'token', 'node', 'attempts')
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
  if j[2] == 'end' then return 'moved' end
elseif j[2] ~= 'waiting' or (mode ~= 'orphan' and j[3] ~= queue) then
  return 'moved'
end
local now = now_s()
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
redis.call('HDEL', jk, unpack(ATTEMPT_FIELDS))
redis.call('HSET', jk, 'stage', 'init', 'phase', 'waiting', 'token', new, 'queue', 'init',
  'requeues', mode == 'leave' and n or n + 1, 't_init_queued', fmt(now),
  'attempts', cjson.encode(history))
set_state(jk, j[1], 'queued', j[5])
release_backend(id)
redis.call('ZADD', K.queued('init'), now, id)
if message and message ~= '' then
  push_message('init', id, message, now)
else
  -- A fresh heartbeat until the caller has published the new INIT message (HANDED_OFF
  -- drops it): should the publish fail, the job goes stale again and a sweep finds it.
  redis.call('ZADD', K.ACTIVE, now, id)
end
return 'requeue'
"""

# Fail every non-terminal job whose deadline has passed; a job a stage is running gets
# grace_s more, for its stage to stop by itself first (its pool ends it otherwise).
# ARGV: ttl_s, limit, grace_s. Returns the number of jobs failed.
EXPIRE_DEADLINES = r"""
local ttl, limit, grace = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3] or '0')
local now = now_s()
local rows = redis.call('ZRANGEBYSCORE', K.DEADLINES, '-inf', now, 'WITHSCORES', 'LIMIT', 0,
                        limit)
local n = 0
for i = 1, #rows, 2 do
  local id, at = rows[i], tonumber(rows[i + 1])
  local jk = K.job(id)
  local j = redis.call('HMGET', jk, 'state', 'phase')
  local state = j[1]
  if state and not TERMINAL[state] and j[2] == 'active' and at + grace > now then
    -- running: its stage stops by itself within the grace, or its pool ends it
  elseif state and not TERMINAL[state] then
    finish(id, jk, 'failed', 'timeout', 'job deadline passed', ttl, now)
    redis.call('HINCRBY', K.REAPER_ACTIONS, 'deadline:failed', 1)
    n = n + 1
  else
    redis.call('ZREM', K.DEADLINES, id)
  end
end
return n
"""

# Release a lock only if this holder still holds it. KEYS: lock. ARGV: value.
RELEASE_LOCK = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
