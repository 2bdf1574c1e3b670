"""Lua for the backend min-heap. Acquire and release are single scripts, atomic across every
worker on every node. ``RELEASE_FN`` is also part of the job store's prelude, so the slot is
freed in the same atomic step as any terminal transition or re-queue of the job.

Keys come from the table ``K`` (:data:`prorl_farm.keys.LUA`): ``K.BACKEND_HEAP`` (zset
backend -> in-flight / capacity), ``K.BACKEND_INFLIGHT`` (hash), ``K.BACKEND_ASSIGN`` (hash
job -> backend), ``K.backend(id)``.
"""

from prorl_farm import keys

RELEASE_FN = r"""
-- The heap's key for a backend with n jobs in flight: what one more job there costs in
-- request time, its own and that it adds to the others'. A turn takes L(k) = s * max(1,
-- k / capacity) with k jobs sharing the backend, s its per-request service time, learnt
-- from latencies (the farm-wide average until it has served one; 1 before anything has).
-- The cost is L(n + 1) + n * (L(n + 1) - L(n)): s while a slot is free, s * (2n + 1) /
-- capacity once they are all taken. So every backend is kept busy, and a slow one takes
-- jobs only while the fast ones' queues would cost more: no batch waits on stragglers
-- queued on a slow backend. The last term breaks ties between backends with room by load.
local function heap_score(b, n)
  local bk = K.backend(b)
  local h = redis.call('HMGET', bk, 'capacity', 'service_ms')
  local cap = tonumber(h[1] or '1')
  local s = tonumber(h[2] or '') or tonumber(redis.call('GET', K.BACKEND_SERVICE_REF) or '')
    or 1
  local after, before = s * math.max(1, (n + 1) / cap), s * math.max(1, n / cap)
  return after + n * (after - before) + 1e-6 * s * (n + 1) / cap
end

-- Free the backend slot a job holds, if any. Returns the backend id or false.
local function release_backend(job)
  local b = redis.call('HGET', K.BACKEND_ASSIGN, job)
  if not b then return false end
  redis.call('HDEL', K.BACKEND_ASSIGN, job)
  if redis.call('EXISTS', K.backend(b)) == 0 then
    redis.call('HDEL', K.BACKEND_INFLIGHT, b)  -- unregistered meanwhile
    return b
  end
  local n = redis.call('HINCRBY', K.BACKEND_INFLIGHT, b, -1)
  if n < 0 then
    redis.call('HSET', K.BACKEND_INFLIGHT, b, 0)
    n = 0
  end
  if redis.call('ZSCORE', K.BACKEND_HEAP, b) then
    redis.call('ZADD', K.BACKEND_HEAP, heap_score(b, n), b)
  end
  return b
end
"""

LATENCY_FN = r"""
local function ema(old, sample, keep)
  return string.format('%.3f', old and keep * old + (1 - keep) * sample or sample)
end

-- Fold n requests of mean latency ms into a backend's moving averages (0.8 per request),
-- if it is still registered: the latency, and the service time, the latency less the
-- queueing its load explains: the requests shared the backend with ``load`` jobs (the
-- in-flight count their pins saw; now's if not given), queued beyond its capacity. The
-- service time re-keys the backend in the heap.
local function record_latency(b, ms, n, load)
  n = n or 1
  local bk = K.backend(b)
  if redis.call('EXISTS', bk) == 0 then return 0 end
  local h = redis.call('HMGET', bk, 'latency_ms', 'service_ms', 'capacity')
  local keep = 0.8 ^ n
  local inflight = tonumber(redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0')
  local service = ms / math.max(1, (load or inflight) / tonumber(h[3] or '1'))
  redis.call('HSET', bk, 'latency_ms', ema(tonumber(h[1] or ''), ms, keep),
             'service_ms', ema(tonumber(h[2] or ''), service, keep))
  redis.call('SET', K.BACKEND_SERVICE_REF,
             ema(tonumber(redis.call('GET', K.BACKEND_SERVICE_REF) or ''), service, keep))
  redis.call('HINCRBY', bk, 'requests_total', n)
  if redis.call('ZSCORE', K.BACKEND_HEAP, b) then
    redis.call('ZADD', K.BACKEND_HEAP, heap_score(b, inflight), b)
  end
  return 1
end
"""

PRELUDE = keys.LUA + RELEASE_FN + LATENCY_FN

# Pin a job to the least-loaded healthy, undrained backend (or return the one it is pinned
# to). ARGV: job, exclude (a backend id not to pick, or ''), audit ('1' or ''), and
# optionally latency to record first (backend, mean ms, requests, load seen or ''), so a
# turn costs one round trip. Returns {backend, 'sticky' | 'new', url, kind, model,
# tokenizer, policy_version, logprobs_mode, max_model_len, in-flight} or {} when no backend
# can take it.
ACQUIRE = r"""
local job, exclude, audit = ARGV[1], ARGV[2], ARGV[3]
if ARGV[4] and ARGV[4] ~= '' then
  record_latency(ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7] or ''))
end
-- A job that ended (cancelled, failed, done) never takes a slot: its terminal transition
-- already released it, and a stage that has not noticed yet must not pin it again.
local state = redis.call('HGET', K.job(job), 'state')
if state == 'done' or state == 'failed' or state == 'cancelled' then return {} end
local FIELDS = {'url', 'kind', 'model', 'tokenizer', 'policy_version', 'logprobs_mode',
                'max_model_len'}
local function pinned(b, how)
  local out = {b, how}
  for _, v in ipairs(redis.call('HMGET', K.backend(b), unpack(FIELDS))) do
    table.insert(out, v or '')
  end
  table.insert(out, redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0')
  return out
end
local cur = redis.call('HGET', K.BACKEND_ASSIGN, job)
if cur then
  if cur ~= exclude and redis.call('EXISTS', K.backend(cur)) == 1 then
    return pinned(cur, 'sticky')
  end
  release_backend(job)
end
local picks = redis.call('ZRANGE', K.BACKEND_HEAP, 0, 1)
local b = picks[1]
if b == exclude then b = picks[2] end
if not b then return {} end
if audit == '1' then  -- the heap as this pick saw it
  local snap = redis.call('ZRANGE', K.BACKEND_HEAP, 0, -1, 'WITHSCORES')
  table.insert(snap, 1, b)
  table.insert(snap, 2, exclude)
  table.insert(snap, 3, tonumber(redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0'))
  redis.call('RPUSH', K.BACKEND_AUDIT, cjson.encode(snap))
end
local n = redis.call('HINCRBY', K.BACKEND_INFLIGHT, b, 1)
redis.call('ZADD', K.BACKEND_HEAP, heap_score(b, n), b)
redis.call('HSET', K.BACKEND_ASSIGN, job, b)
redis.call('HINCRBY', K.backend(b), 'jobs_total', 1)
return pinned(b, 'new')
"""

# ARGV: job. Returns the backend released, or false.
RELEASE = r"""
return release_backend(ARGV[1])
"""

# Update a backend's fields, then put it in the heap at its current load if it is healthy,
# not drained and its weights passed their check (no weights_error), else take it out.
# ARGV: backend, then field/value pairs.
# Returns 1 (in the heap), 0 (out of it), -1 (no such backend: nothing written).
UPDATE = r"""
local b = ARGV[1]
local bk = K.backend(b)
if redis.call('EXISTS', bk) == 0 then
  redis.call('ZREM', K.BACKEND_HEAP, b)
  return -1
end
for i = 2, #ARGV, 2 do
  if ARGV[i] == 'policy_version' and
      tonumber(ARGV[i + 1]) < (tonumber(redis.call('HGET', bk, 'policy_version')) or 0) then
    return -2  -- a policy version only grows: nothing changed
  end
end
for i = 2, #ARGV, 2 do redis.call('HSET', bk, ARGV[i], ARGV[i + 1]) end
local h = redis.call('HMGET', bk, 'healthy', 'drained', 'weights_error')
if h[1] ~= '1' or h[2] == '1' or (h[3] and h[3] ~= '') then
  redis.call('ZREM', K.BACKEND_HEAP, b)
  return 0
end
local n = tonumber(redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0')
redis.call('ZADD', K.BACKEND_HEAP, heap_score(b, n), b)
return 1
"""

# Exponentially weighted request latency. ARGV: backend, latency_ms.
RECORD_LATENCY = r"""
return record_latency(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3] or '1'),
                      tonumber(ARGV[4] or ''))
"""
