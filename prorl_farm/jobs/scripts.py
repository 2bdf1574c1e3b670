"""Lua scripts for atomic job transitions.

Every script receives the key prefix as ARGV[1] and builds its keys from it and from
the job id (the job's batch and queue are read from the job hash, so they cannot be
declared up front; the farm targets a single Redis, not Redis Cluster). Times come
from Redis ``TIME`` so that timings agree across nodes whatever their clocks say.

Job hash fields: ``id batch_id handler instance sampling sample_index state stage phase
token queue node worker requeues created_at deadline_at finished_at failure_kind
failure_message hstate result reward`` and ``t_<stage>_{queued,start,end}``.
"""

from prorl_farm.llm.scripts import RELEASE_FN

PRELUDE = r"""
local P = ARGV[1]
local TERMINAL = {done = true, failed = true, cancelled = true}
local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end
local function jkey(id) return P .. 'job:' .. id end
""" + RELEASE_FN + r"""

-- Move a job to another state, keeping its batch's per-state counters exact.
local function set_state(jk, old, new, batch)
  if old == new then return end
  redis.call('HSET', jk, 'state', new)
  local ck = P .. 'batch:' .. batch .. ':counts'
  redis.call('HINCRBY', ck, old, -1)
  redis.call('HINCRBY', ck, new, 1)
end

-- The one way into a terminal state. Returns "<old state>:<old phase>:<old token>".
local function finish(id, jk, state, kind, msg, ttl, now)
  local j = redis.call('HMGET', jk, 'state', 'stage', 'phase', 'batch_id', 'queue', 'token')
  local old, stage, phase, batch, queue, token = j[1], j[2], j[3], j[4], j[5], j[6]
  if phase == 'active' then redis.call('HSET', jk, 't_' .. stage .. '_end', fmt(now)) end
  redis.call('HSET', jk, 'phase', 'end', 'finished_at', fmt(now))
  if kind ~= '' then
    redis.call('HSET', jk, 'failure_kind', kind, 'failure_message', msg)
  end
  set_state(jk, old, state, batch)
  release_backend(id)
  local bk = P .. 'batch:' .. batch
  redis.call('XADD', bk .. ':stream', '*', 'job', id, 'state', state)
  redis.call('ZREM', P .. 'active', id)
  redis.call('ZREM', P .. 'deadlines', id)
  if queue then redis.call('ZREM', P .. 'queued:' .. queue, id) end
  redis.call('HINCRBY', P .. 'stats', state, 1)
  redis.call('EXPIRE', jk, ttl)
  for _, suffix in ipairs({'', ':counts', ':stream', ':jobs'}) do
    redis.call('EXPIRE', bk .. suffix, ttl)
  end
  return old .. ':' .. phase .. ':' .. (token or '')
end
"""

# Claim a stage for a worker. ARGV: prefix, job, stage, token, worker, ttl_s.
# Returns {"ok", <HGETALL>} | {"missing"} | {"terminal"} | {"stale"} | {"expired"}.
# "stale": the message is a redelivery of a stage that already ran or is running.
CLAIM = r"""
local id, stage, token, worker, ttl = ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local jk = jkey(id)
local j = redis.call('HMGET', jk, 'state', 'stage', 'phase', 'token', 'deadline_at', 'batch_id', 'queue')
if not j[1] then return {'missing'} end
if TERMINAL[j[1]] then return {'terminal'} end
if j[2] ~= stage or j[4] ~= token or j[3] ~= 'waiting' then return {'stale'} end
local now = now_s()
if j[5] and j[5] ~= '' and tonumber(j[5]) <= now then
  finish(id, jk, 'failed', 'timeout', 'deadline passed while queued for ' .. stage, ttl, now)
  return {'expired'}
end
redis.call('HSET', jk, 'phase', 'active', 'worker', worker, 't_' .. stage .. '_start', fmt(now))
set_state(jk, j[1], stage, j[6])
redis.call('ZADD', P .. 'active', now, id)
if j[7] then
  -- Queues are FIFO: remember the newest enqueue time claimed from this queue, so that the
  -- reaper can tell a message lost in transit (older, unclaimed, held by no one).
  local qk = P .. 'queued:' .. j[7]
  local t = redis.call('ZSCORE', qk, id)
  local last = redis.call('HGET', P .. 'claimed', j[7])
  if t and (not last or tonumber(t) > tonumber(last)) then
    redis.call('HSET', P .. 'claimed', j[7], t)
  end
  redis.call('ZREM', qk, id)
end
return {'ok', redis.call('HGETALL', jk)}
"""

# Hand a job from a finished stage to the next one's queue.
# ARGV: prefix, job, from_stage, token, to_stage, new_token, queue, node, field, value.
# The job stays in the active set under this worker's heartbeat until HANDED_OFF runs
# after the publish, so a crash between the two is caught by the reaper.
ADVANCE = r"""
local id, from, token, to, new = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local queue, node, field, value = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local jk = jkey(id)
local j = redis.call('HMGET', jk, 'state', 'phase', 'token', 'batch_id')
if not j[1] then return 'missing' end
if TERMINAL[j[1]] then return 'terminal' end
if j[1] ~= from or j[3] ~= token or j[2] ~= 'active' then return 'stale' end
local now = now_s()
redis.call('HSET', jk, 't_' .. from .. '_end', fmt(now), 'stage', to, 'phase', 'waiting',
  'token', new, 'queue', queue, 't_' .. to .. '_queued', fmt(now), 'node', node, field, value)
set_state(jk, j[1], to, j[4])
release_backend(id)  -- a backend slot is held within a stage, never across a hand-off
redis.call('ZADD', P .. 'queued:' .. queue, now, id)
redis.call('SADD', P .. 'queues', queue)
return 'ok'
"""

# After the publish: drop the previous worker's heartbeat of each job unless the next stage
# already claimed it. ARGV: prefix, then job/new_token pairs.
HANDED_OFF = r"""
for i = 2, #ARGV, 2 do
  local j = redis.call('HMGET', jkey(ARGV[i]), 'token', 'phase')
  if j[1] == ARGV[i + 1] and j[2] == 'waiting' then redis.call('ZREM', P .. 'active', ARGV[i]) end
end
return 1
"""

# Terminal transition. ARGV: prefix, job, token ('' = any), state, kind, message, ttl_s,
# then field/value pairs to set. Returns "ok:<old state>:<old phase>:<old token>",
# "terminal:<state>", "stale" or "missing".
FINISH = r"""
local id, token, state, kind, msg, ttl = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], tonumber(ARGV[7])
local jk = jkey(id)
local j = redis.call('HMGET', jk, 'state', 'token', 'phase')
if not j[1] then return 'missing' end
if TERMINAL[j[1]] then return 'terminal:' .. j[1] end
if token ~= '' and (j[2] ~= token or j[3] ~= 'active') then return 'stale' end
for i = 8, #ARGV, 2 do redis.call('HSET', jk, ARGV[i], ARGV[i + 1]) end
return 'ok:' .. finish(id, jk, state, kind, msg, ttl, now_s())
"""

# Refresh the heartbeat of jobs a worker holds (reserved or running).
# ARGV: prefix, then job/token pairs. Returns the flat job/token pairs the worker must
# abort: the job is gone, terminal, or has moved on to another attempt.
HEARTBEAT = r"""
local now = now_s()
local abort = {}
for i = 2, #ARGV, 2 do
  local id, tok = ARGV[i], ARGV[i + 1]
  local j = redis.call('HMGET', jkey(id), 'state', 'token')
  if j[1] and not TERMINAL[j[1]] and j[2] == tok then
    redis.call('ZADD', P .. 'active', now, id)
  else
    abort[#abort + 1] = id
    abort[#abort + 1] = tok
  end
end
return abort
"""

# Recover a job whose worker died. ARGV: prefix, job, mode ('active' | 'queued' | 'orphan'),
# cutoff (epoch s: a heartbeat older than this is dead), queue (for 'queued'; for 'orphan'
# the token of the orphaned message),
# max_requeues, new_token, ttl_s, message.
# Returns 'alive' | 'gone' | 'moved' | 'requeue' (caller publishes to init, then calls
# HANDED_OFF) | 'failed'.
REAP = r"""
local id, mode, cutoff, queue = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
local maxrq, new, ttl, msg = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8]), ARGV[9]
local jk = jkey(id)
local j = redis.call('HMGET', jk, 'state', 'phase', 'queue', 'requeues', 'batch_id', 'stage')
if not j[1] or TERMINAL[j[1]] then
  redis.call('ZREM', P .. 'active', id)
  if queue ~= '' then redis.call('ZREM', P .. 'queued:' .. queue, id) end
  return 'gone'
end
local beat = redis.call('ZSCORE', P .. 'active', id)
if beat and tonumber(beat) >= cutoff then return 'alive' end
if mode == 'active' then
  if not beat then return 'alive' end
elseif mode == 'orphan' then
  -- ARGV[5] is the token of a message a dead worker had reserved
  if j[2] ~= 'waiting' or redis.call('HGET', jk, 'token') ~= queue then return 'moved' end
elseif j[2] ~= 'waiting' or j[3] ~= queue then
  redis.call('ZREM', P .. 'queued:' .. queue, id)
  return 'moved'
end
local now = now_s()
local n = tonumber(j[4] or '0')
if n < maxrq then
  if j[2] == 'active' then redis.call('HSET', jk, 't_' .. j[6] .. '_end', fmt(now)) end
  if j[3] then redis.call('ZREM', P .. 'queued:' .. j[3], id) end
  redis.call('HSET', jk, 'stage', 'init', 'phase', 'waiting', 'token', new, 'queue', 'init',
    'requeues', n + 1, 't_init_queued', fmt(now), 'last_requeue_reason', msg)
  set_state(jk, j[1], 'queued', j[5])
  release_backend(id)
  -- The job keeps its stale heartbeat until the caller has published the new INIT message
  -- (HANDED_OFF): should the publish fail, the next sweep finds it again.
  redis.call('ZADD', P .. 'queued:init', now, id)
  return 'requeue'
end
finish(id, jk, 'failed', 'worker_lost', msg, ttl, now)
return 'failed'
"""

# Fail every non-terminal job whose deadline has passed. ARGV: prefix, ttl_s, limit.
# Returns the number of jobs failed.
EXPIRE_DEADLINES = r"""
local ttl, limit = tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_s()
local ids = redis.call('ZRANGEBYSCORE', P .. 'deadlines', '-inf', now, 'LIMIT', 0, limit)
local n = 0
for _, id in ipairs(ids) do
  local jk = jkey(id)
  local state = redis.call('HGET', jk, 'state')
  if state and not TERMINAL[state] then
    finish(id, jk, 'failed', 'timeout', 'job deadline passed', ttl, now)
    n = n + 1
  else
    redis.call('ZREM', P .. 'deadlines', id)
  end
end
return n
"""
