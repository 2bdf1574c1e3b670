-- backend_record_latency: fold requests into a backend's moving averages of latency.
-- uses: latency
-- KEYS: (none)
-- ARGV: backend, latency_ms, requests, load
--   load: the in-flight count the requests saw ('' = now's)
-- returns: 1 | 0 (no such backend)

return record_latency(ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3] or '1'),
                      tonumber(ARGV[4] or ''))
