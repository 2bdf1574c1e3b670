-- lib fair: each queue's pool slots shared between tenants by weighted fair share.
--
-- A job that may run on a queue either takes a slot at once (its message pushed onto the
-- queue's list) or waits in its tenant's pen for that queue (its message kept in the queue's
-- pen messages). A slot is held from the push until the job leaves the stage (hands off, ends or
-- is re-queued); each release runs the pick, which hands the freed slot on:
-- - while fewer slots are held than the queue's live pools share out, to the waiting tenant
--   holding the fewest per weight;
-- - past that, from the pools' reserve, only to a tenant holding less than its due (the
--   shared slots times its weight over the weights of the tenants holding or waiting), so a
--   tenant that arrives behind another's flood starts at once, without preempting anything.
-- Within a tenant its jobs go by their place: when they came (in microseconds, the jobs of
-- one submission a microsecond apart, in order), less a head start of `prio_s` (priority
-- times the aging time), so a higher priority goes first and a lower one is overtaken only
-- by jobs that came less than the difference before it (no starvation).
-- uses: (none)

-- The queue's live slots, summed from its pools' registrations (lapsed ones left out).
local function fair_count_slots(queue, now)
  local shared, reserve = 0, 0
  local flat = redis.call('HGETALL', K.slots(queue))
  for i = 1, #flat, 2 do
    local s, r, untl = string.match(flat[i + 1], '^(%S+) (%S+) (%S+)$')
    if untl and tonumber(untl) > now then
      shared = shared + tonumber(s)
      reserve = reserve + tonumber(r)
    end
  end
  return shared, reserve
end

-- The queue's live slots (shared, reserve) and the slots held: the sums fair_fill keeps
-- beside the counts of slots held (renewed each pool beat), or summed here where missing.
local function fair_slots(queue, now)
  local t = redis.call('HMGET', K.held(queue), '#shared', '#reserve', '*')
  local total = tonumber(t[3] or '0')
  if t[1] then return tonumber(t[1]), tonumber(t[2] or '0'), total end
  local shared, reserve = fair_count_slots(queue, now)
  return shared, reserve, total
end

local function fair_weight(w)
  w = tonumber(w)
  if w and w > 0 then return w end
  return 1
end

-- Give `id` (of `tenant`) a slot of `queue`: its message onto the list, recorded on the
-- queue's index with the push time (popped.lua), its slot counted (and, from the reserve,
-- the farm's count of those).
local function fair_push(queue, id, jk, tenant, message, now, stage, reserve)
  redis.call('LPUSH', queue, message)
  redis.call('ZADD', K.queued(queue), now, id)
  redis.call('HSET', jk, 'slot', queue)
  redis.call('HINCRBY', K.held(queue), tenant, 1)
  redis.call('HINCRBY', K.held(queue), '*', 1)
  if reserve then redis.call('HINCRBY', K.FAIR_GIVEN, stage .. ':' .. tenant .. ':reserve', 1) end
end

local function stage_of(queue)
  return string.match(queue, '^([a-z]+)')
end

-- Hand out free slots of `queue` to waiting jobs, at most `budget`; returns how many.
local function fair_pick(queue, now, budget)
  local given = 0
  local stage = stage_of(queue)
  local shared, reserve
  while given < budget do
    local waiting = redis.call('SMEMBERS', K.pen_tenants(queue))
    if #waiting == 0 then break end
    local flat = redis.call('HGETALL', K.held(queue))
    local held = {}
    for i = 1, #flat, 2 do held[flat[i]] = tonumber(flat[i + 1]) end
    if not shared then
      shared, reserve = held['#shared'], held['#reserve'] or 0
      if not shared then shared, reserve = fair_count_slots(queue, now) end
    end
    local total = held['*'] or 0
    if total >= shared + reserve then break end
    -- The tenants holding or waiting, and their weights (none needed for one tenant waiting
    -- for a shared slot).
    local weight, sum = {}, 0
    if #waiting > 1 or total >= shared then
      local names, seen = {}, {}
      for _, t in ipairs(waiting) do names[#names + 1] = t; seen[t] = true end
      for t, n in pairs(held) do
        if n > 0 and not seen[t] and string.find(t, '^[#*]') == nil then
          names[#names + 1] = t
        end
      end
      local ws = redis.call('HMGET', K.WEIGHTS, unpack(names))
      for i, t in ipairs(names) do
        weight[t] = fair_weight(ws[i])
        sum = sum + weight[t]
      end
    end
    local from_reserve = total >= shared
    local best, best_ratio, best_head, best_score
    local popped = false
    if #waiting == 1 and not from_reserve then
      -- One tenant waits and a shared slot is free: its head job takes it (its pen, found
      -- empty, leaves the set of tenants waiting).
      local head = redis.call('ZPOPMIN', K.pen(queue, waiting[1]))
      if #head == 0 then
        redis.call('SREM', K.pen_tenants(queue), waiting[1])
      else
        best, best_head, popped = waiting[1], head[1], true
      end
      waiting = {}
    end
    for _, t in ipairs(waiting) do
      local h = held[t] or 0
      local ok = not from_reserve or h < shared * weight[t] / sum
      if ok then
        local ratio = h / weight[t]
        if not best or ratio <= best_ratio then
          local head = redis.call('ZRANGE', K.pen(queue, t), 0, 0, 'WITHSCORES')
          if #head == 0 then
            redis.call('SREM', K.pen_tenants(queue), t)
          elseif not best or ratio < best_ratio or tonumber(head[2]) < best_score then
            best, best_ratio, best_head, best_score = t, ratio, head[1], tonumber(head[2])
          end
        end
      end
    end
    if not best then break end
    -- (A pen left empty stays in the set of tenants waiting until a pick finds it so.)
    if not popped then redis.call('ZREM', K.pen(queue, best), best_head) end
    local jk = K.job(best_head)
    local message = redis.call('HGET', K.pen_messages(queue), best_head)
    redis.call('HDEL', K.pen_messages(queue), best_head)
    local j = redis.call('HMGET', jk, 'phase', 'queue')
    if message and j[1] == 'waiting' and j[2] == queue then
      fair_push(queue, best_head, jk, best, message, now, stage, from_reserve)
      given = given + 1
    end
  end
  return given
end

-- What fair_release read of a job, for fair_enter in the same script (a hand-off).
local fair_read = {}

-- The job's tenant and head start.
local function fair_of(jk)
  local f = fair_read[jk] or redis.call('HMGET', jk, 'slot', 'tenant', 'prio_s')
  return f[2] or 'default', tonumber(f[3] or '0') or 0
end

-- A job's place in a pen: when it came, in microseconds, less its head start; `k`: its
-- index in its submission.
local function fair_place(now, head_start, k)
  return math.floor((now - head_start) * 1e6) + k
end

-- A job now waits for a slot of `queue`: it takes one at once if one is free and nobody
-- waits for it, else it waits in its tenant's pen, and the pick runs unless every slot,
-- reserve too, is held.
local function fair_enter(queue, id, jk, message, now)
  local tenant, head_start = fair_of(jk)
  local shared, reserve, total = fair_slots(queue, now)
  if total < shared and redis.call('EXISTS', K.pen_tenants(queue)) == 0 then
    fair_push(queue, id, jk, tenant, message, now, stage_of(queue), false)
    return
  end
  redis.call('HSET', K.pen_messages(queue), id, message)
  redis.call('ZADD', K.pen(queue, tenant), fair_place(now, head_start, 0), id)
  redis.call('SADD', K.pen_tenants(queue), tenant)
  if total < shared + reserve then fair_pick(queue, now, 1) end
end

-- The job leaves the slot it holds, if any, and the pick hands it on.
local function fair_release(id, jk, now)
  local f = redis.call('HMGET', jk, 'slot', 'tenant', 'prio_s')
  fair_read[jk] = f
  if not f[1] then return end
  local queue, tenant = f[1], f[2] or 'default'
  redis.call('HDEL', jk, 'slot')
  if redis.call('HINCRBY', K.held(queue), tenant, -1) <= 0 then
    redis.call('HDEL', K.held(queue), tenant)
  end
  redis.call('HINCRBY', K.held(queue), '*', -1)
  fair_pick(queue, now, 1)
end

-- The job no longer waits in a pen of `queue` (it ended or moved elsewhere).
local function fair_unpen(id, jk, queue)
  local tenant = redis.call('HGET', jk, 'tenant') or 'default'
  local pen = K.pen(queue, tenant)
  if redis.call('ZREM', pen, id) == 1 then
    redis.call('HDEL', K.pen_messages(queue), id)
    if redis.call('ZCARD', pen) == 0 then redis.call('SREM', K.pen_tenants(queue), tenant) end
  end
end
