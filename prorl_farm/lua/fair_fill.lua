-- fair_fill: a pool process registers the slots it takes of its queue (renewed at each pool
-- beat, lapsing if it stops) and the queue's live slots are summed again (fields `#shared`
-- and `#reserve` of its held counts, read by every pick), the farm's tenant weights are written, and the pick
-- hands the queue's free slots to the jobs waiting in its pens (lib/fair.lua). A registration
-- clears the queue's left mark (lua/leave_sweep.lua).
-- uses: jobs
-- KEYS: slots, held, pens, weights
--   the queue's K.slots, K.held and K.pen_flows, and K.WEIGHTS (the pick reads them).
-- ARGV: queue, pool, shared, reserve, ttl_s, limit, tenant_weights...
--   pool: the process's presence name. shared, reserve: its slots (0 and 0: it leaves).
--   limit: the most jobs given a slot. tenant_weights: tenant, weight, tenant, weight, ...
-- returns: the number of jobs given a slot

local queue, pool, shared, reserve = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if KEYS[1] ~= K.slots(queue) or KEYS[2] ~= K.held(queue) or KEYS[3] ~= K.pen_flows(queue)
    or KEYS[4] ~= K.WEIGHTS then
  return redis.error_reply('fair_fill: KEYS are not the keys of queue ' .. queue)
end
local now = now_s()
local old = redis.call('HGET', KEYS[1], pool)
local same = old and string.match(old, '^(%S+ %S+) ') == shared .. ' ' .. reserve
if shared + reserve > 0 then
  redis.call('HSET', KEYS[1], pool, shared .. ' ' .. reserve .. ' ' .. fmt(now + tonumber(ARGV[5])))
  redis.call('HDEL', K.LEFT, queue)  -- a pool serves the queue (again): not left
else
  redis.call('HDEL', KEYS[1], pool)
end
-- A registration that changes the queue's slots (a pool comes, goes or resizes) renews the
-- sums the scripts read at once; a renewal of the same slots, at most once a second: the
-- scan below reads every registration of the queue, and the global `init` queue has one
-- per node, each renewed every pool beat (a scan per renewal grew as nodes squared:
-- bench/control_plane.py).
local swept = tonumber(redis.call('HGET', KEYS[2], '#swept') or '0')
if not same or now - swept >= 1 then
  -- Lapsed registrations (pools that died) go; the sums the scripts read are renewed.
  local flat = redis.call('HGETALL', KEYS[1])
  for i = 1, #flat, 2 do
    local untl = string.match(flat[i + 1], ' (%S+)$')
    if not untl or tonumber(untl) <= now then redis.call('HDEL', KEYS[1], flat[i]) end
  end
  local total_shared, total_reserve = fair_count_slots(queue, now)
  redis.call('HSET', KEYS[2], '#shared', total_shared, '#reserve', total_reserve,
             '#swept', fmt(now))
  -- The flows holding nothing now leave the table of slots held.
  for f, n in pairs(fair_held(queue, now)) do
    if fair_flow_of(f) and n <= 0 then redis.call('HDEL', KEYS[2], f) end
  end
end
if #ARGV > 6 then redis.call('HSET', KEYS[4], unpack(ARGV, 7)) end
return fair_pick(queue, now, tonumber(ARGV[6]))
