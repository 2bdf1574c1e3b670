-- lib backends: the backend min-heaps (one per tenant), their keys and the release of a
-- job's slot.

-- The heap of a tenant's backends: a tenant's jobs are pinned to its own backends only
-- (keys.py backend_heap is the same rule). The default tenant's is K.BACKEND_HEAP.
local function tenant_heap(tenant)
  if not tenant or tenant == '' or tenant == 'default' then return K.BACKEND_HEAP end
  return K.BACKEND_HEAP .. ':' .. tenant
end

-- The heap a registered backend belongs in: its tenant's.
local function heap_of(b)
  return tenant_heap(redis.call('HGET', K.backend(b), 'tenant'))
end

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

-- Free the backend slot a job holds, if any. ``held``: the job's ``backend`` field as the
-- caller read it (false: it holds none, nothing to look up), or nil to look it up; the pin
-- itself (BACKEND_ASSIGN) decides. Returns the backend id or false.
local function release_backend(job, held)
  if held == false then return false end
  local b = redis.call('HGET', K.BACKEND_ASSIGN, job)
  if not b then return false end
  redis.call('HDEL', K.BACKEND_ASSIGN, job)
  redis.call('HDEL', K.job(job), 'backend')
  if redis.call('EXISTS', K.backend(b)) == 0 then
    redis.call('HDEL', K.BACKEND_INFLIGHT, b)  -- unregistered meanwhile
    return b
  end
  local n = redis.call('HINCRBY', K.BACKEND_INFLIGHT, b, -1)
  if n < 0 then
    redis.call('HSET', K.BACKEND_INFLIGHT, b, 0)
    n = 0
  end
  local heap = heap_of(b)
  if redis.call('ZSCORE', heap, b) then
    redis.call('ZADD', heap, heap_score(b, n), b)
  end
  return b
end
