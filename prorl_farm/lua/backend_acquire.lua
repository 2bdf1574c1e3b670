-- backend_acquire: pin a job to the least-loaded healthy, undrained backend of its tenant
-- (or return the one it is pinned to), first recording the latency of its earlier
-- requests, so a turn costs one round trip.
-- uses: backends, latency
-- KEYS: (none)
-- ARGV: job, exclude, audit, latency_backend, latency_ms, latency_requests, latency_load
--   exclude: a backend not to pick, or ''. audit: '1' logs the heap as the pick saw it.
--   latency_*: '' = nothing to record; load: the in-flight count the requests saw ('' =
--   now's).
-- returns: {backend, 'sticky' | 'new', BACKEND_FIELDS' values, in-flight} | {} (no
--   backend can take it)

local job, exclude, audit = ARGV[1], ARGV[2], ARGV[3]
if ARGV[4] and ARGV[4] ~= '' then
  record_latency(ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7] or ''))
end
-- A job that ended (cancelled, failed, done) never takes a slot: its terminal transition
-- already released it, and a stage that has not noticed yet must not pin it again.
local jf = redis.call('HMGET', K.job(job), 'state', 'tenant')
local state = jf[1]
if state and TERMINAL[state] then return {} end
-- Its tenant's backends only: another tenant's server never sees its prompts. The tenant
-- is the job's own field, written with the job and never changed (a batch's record is
-- read by nothing that routes).
local heap = tenant_heap(jf[2])
local function pinned(b, how)
  local out = {b, how}
  for _, v in ipairs(redis.call('HMGET', K.backend(b), unpack(BACKEND_FIELDS))) do
    table.insert(out, v or '')
  end
  table.insert(out, redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0')
  return out
end
local cur = redis.call('HGET', K.BACKEND_ASSIGN, job)
if cur then
  -- Sticky, unless its weights failed (a load or check in place): the job moves on.
  if cur ~= exclude and redis.call('EXISTS', K.backend(cur)) == 1
      and (redis.call('HGET', K.backend(cur), 'weights_error') or '') == '' then
    return pinned(cur, 'sticky')
  end
  release_backend(job)
end
local picks = redis.call('ZRANGE', heap, 0, 1)
local b = picks[1]
if b == exclude then b = picks[2] end
if not b then return {} end
if audit == '1' then  -- the heap as this pick saw it
  local snap = redis.call('ZRANGE', heap, 0, -1, 'WITHSCORES')
  table.insert(snap, 1, b)
  table.insert(snap, 2, exclude)
  table.insert(snap, 3, tonumber(redis.call('HGET', K.BACKEND_INFLIGHT, b) or '0'))
  redis.call('RPUSH', K.BACKEND_AUDIT, cjson.encode(snap))
end
local n = redis.call('HINCRBY', K.BACKEND_INFLIGHT, b, 1)
redis.call('ZADD', heap, heap_score(b, n), b)
redis.call('HSET', K.BACKEND_ASSIGN, job, b)
-- Mirrored on the job, so that its transitions free a slot without looking one up.
if state then redis.call('HSET', K.job(job), 'backend', b) end
redis.call('HINCRBY', K.backend(b), 'jobs_total', 1)
return pinned(b, 'new')
