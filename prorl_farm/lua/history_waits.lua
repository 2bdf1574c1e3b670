-- history_waits: the queue waits of the jobs the stages claimed since the last call, from
-- the stages' wait histograms (kept by each claim, lib/metrics.lua), into the dashboard's
-- history of this minute: `wait_sum:<stage>` and `wait_n:<stage>` (prorl_farm/history.py).
-- The process that leads the reaping calls it every history.SAMPLE_S, so that a claim writes
-- only its histogram. Atomic: two callers at once count each wait once.
-- uses: jobs
-- KEYS: (none)
-- ARGV: stages...
-- returns: the number of waits recorded

local get = {}
for slot = 0, #BUCKETS do
  get[#get + 1] = 'GET'
  get[#get + 1] = 'i64'
  get[#get + 1] = '#' .. slot
end
get[#get + 1] = 'GET'
get[#get + 1] = 'i64'
get[#get + 1] = '#' .. SUM_SLOT
local now = now_s()
local out, seen, recorded = {}, {}, 0
for i = 1, #ARGV do
  local stage = ARGV[i]
  local v = redis.call('BITFIELD', K.histogram('wait:' .. stage), unpack(get))
  local n = 0
  for b = 1, #BUCKETS + 1 do n = n + v[b] end
  local sum = v[#BUCKETS + 2]
  local last = redis.call('HMGET', K.HISTORY_WAITS_SEEN, 'n:' .. stage, 'sum:' .. stage)
  local dn, ds = n - (tonumber(last[1]) or 0), sum - (tonumber(last[2]) or 0)
  if dn < 0 or ds < 0 then dn, ds = n, sum end  -- the histogram was started again
  if dn > 0 then
    out[#out + 1] = 'wait_sum:' .. stage
    out[#out + 1] = ds / 1e6
    out[#out + 1] = 'wait_n:' .. stage
    out[#out + 1] = dn
    recorded = recorded + dn
  end
  seen[#seen + 1] = 'n:' .. stage
  seen[#seen + 1] = n
  seen[#seen + 1] = 'sum:' .. stage
  seen[#seen + 1] = sum
end
if #seen > 0 then redis.call('HSET', K.HISTORY_WAITS_SEEN, unpack(seen)) end
if #out > 0 then history(now, out) end
return recorded
