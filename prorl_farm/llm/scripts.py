"""Lua for the backend min-heap. Acquire and release are single scripts, atomic across every
worker on every node. ``RELEASE_FN`` is also part of the job store's prelude, so the slot is
freed in the same atomic step as any terminal transition or re-queue of the job.

Keys (from the prefix ``P``): ``backends:heap`` (zset backend -> in-flight / capacity),
``backends:inflight`` (hash), ``backends:assign`` (hash job -> backend), ``backend:<id>``.
"""

RELEASE_FN = r"""
-- Free the backend slot a job holds, if any. Returns the backend id or false.
local function release_backend(job)
  local b = redis.call('HGET', P .. 'backends:assign', job)
  if not b then return false end
  redis.call('HDEL', P .. 'backends:assign', job)
  if redis.call('EXISTS', P .. 'backend:' .. b) == 0 then
    redis.call('HDEL', P .. 'backends:inflight', b)  -- unregistered meanwhile
    return b
  end
  local n = redis.call('HINCRBY', P .. 'backends:inflight', b, -1)
  if n < 0 then
    redis.call('HSET', P .. 'backends:inflight', b, 0)
    n = 0
  end
  if redis.call('ZSCORE', P .. 'backends:heap', b) then
    local cap = tonumber(redis.call('HGET', P .. 'backend:' .. b, 'capacity') or '1')
    redis.call('ZADD', P .. 'backends:heap', n / cap, b)
  end
  return b
end
"""

PRELUDE = r"""
local P = ARGV[1]
""" + RELEASE_FN

# Pin a job to the least-loaded healthy, undrained backend (or return the one it is pinned
# to). ARGV: prefix, job, exclude (a backend id not to pick, or ''), audit ('1' or '').
# Returns {backend, 'sticky' | 'new'} or {} when no backend can take it.
ACQUIRE = r"""
local job, exclude, audit = ARGV[2], ARGV[3], ARGV[4]
local cur = redis.call('HGET', P .. 'backends:assign', job)
if cur then
  if cur ~= exclude and redis.call('EXISTS', P .. 'backend:' .. cur) == 1 then
    return {cur, 'sticky'}
  end
  release_backend(job)
end
local picks = redis.call('ZRANGE', P .. 'backends:heap', 0, 1)
local b = picks[1]
if b == exclude then b = picks[2] end
if not b then return {} end
local n = redis.call('HINCRBY', P .. 'backends:inflight', b, 1)
local cap = tonumber(redis.call('HGET', P .. 'backend:' .. b, 'capacity') or '1')
redis.call('ZADD', P .. 'backends:heap', n / cap, b)
redis.call('HSET', P .. 'backends:assign', job, b)
redis.call('HINCRBY', P .. 'backend:' .. b, 'jobs_total', 1)
if audit == '1' then
  local snap = redis.call('ZRANGE', P .. 'backends:heap', 0, -1, 'WITHSCORES')
  table.insert(snap, 1, b)
  table.insert(snap, 2, cap)
  redis.call('RPUSH', P .. 'backends:audit', cjson.encode(snap))
end
return {b, 'new'}
"""

# ARGV: prefix, job. Returns the backend released, or false.
RELEASE = r"""
return release_backend(ARGV[2])
"""

# Update a backend's fields, then put it in the heap at its current load if it is healthy
# and not drained, else take it out. ARGV: prefix, backend, then field/value pairs.
# Returns 1 (in the heap), 0 (out of it), -1 (no such backend: nothing written).
UPDATE = r"""
local b = ARGV[2]
local bk = P .. 'backend:' .. b
if redis.call('EXISTS', bk) == 0 then
  redis.call('ZREM', P .. 'backends:heap', b)
  return -1
end
for i = 3, #ARGV, 2 do redis.call('HSET', bk, ARGV[i], ARGV[i + 1]) end
local h = redis.call('HMGET', bk, 'healthy', 'drained', 'capacity')
if h[1] ~= '1' or h[2] == '1' then
  redis.call('ZREM', P .. 'backends:heap', b)
  return 0
end
local n = tonumber(redis.call('HGET', P .. 'backends:inflight', b) or '0')
redis.call('ZADD', P .. 'backends:heap', n / tonumber(h[3]), b)
return 1
"""

# Exponentially weighted request latency. ARGV: prefix, backend, latency_ms.
RECORD_LATENCY = r"""
local bk = P .. 'backend:' .. ARGV[2]
if redis.call('EXISTS', bk) == 0 then return 0 end
local ms = tonumber(ARGV[3])
local old = tonumber(redis.call('HGET', bk, 'latency_ms') or '')
redis.call('HSET', bk, 'latency_ms', string.format('%.3f', old and (0.8 * old + 0.2 * ms) or ms))
redis.call('HINCRBY', bk, 'requests_total', 1)
return 1
"""
