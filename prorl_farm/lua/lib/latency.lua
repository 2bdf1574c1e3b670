-- lib latency: a backend's moving averages of request latency and service time.
-- uses: backends

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
  local heap = heap_of(b)
  if redis.call('ZSCORE', heap, b) then
    redis.call('ZADD', heap, heap_score(b, inflight), b)
  end
  return 1
end
