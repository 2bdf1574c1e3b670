-- lib fair: each queue's pool slots shared between tenants by weighted fair share, then
-- between each tenant's batches.
--
-- A job that may run on a queue either takes a slot at once (its message pushed onto the
-- queue's list) or waits in its flow's pen for that queue (its message kept in the queue's
-- pen messages). A flow is one batch's jobs: "<tenant>|<head start>|<batch>". A slot is held
-- from the push until the job leaves the stage (hands off, ends or is re-queued); each
-- release runs the pick, which hands the freed slot on:
-- - while fewer slots are held than the queue's live pools share out, to the waiting tenant
--   holding the fewest per weight (the slots its flows hold, summed);
-- - past that, from the pools' reserve, only to a tenant holding less than its due (the
--   shared slots times its weight over the weights of the tenants holding or waiting), so a
--   tenant that arrives behind another's flood starts at once, without preempting anything.
-- Within the tenant, priority first: the flow whose head has the earliest place sets the
-- head start that goes now; among the tenant's flows of that head start (batches of the same
-- priority), the one holding the fewest slots, then the earliest head. A job's place is when
-- it came (in microseconds, the jobs of one submission a microsecond apart, in order), less
-- its head start `prio_s` (priority times the aging time), so a higher priority goes first
-- and a lower one is overtaken only by jobs that came less than the difference before it (no
-- starvation).
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

-- The queue's held table (one read): flow -> slots held, and the live slots, `#shared` and
-- `#reserve`, the sums fair_fill keeps beside them (renewed each pool beat). Returns the
-- table, the shared and reserve slots (summed here where the sums are missing) and the
-- slots held in all.
local function fair_held(queue, now)
  local flat = redis.call('HGETALL', K.held(queue))
  local held, total = {}, 0
  for i = 1, #flat, 2 do
    local n = tonumber(flat[i + 1])
    held[flat[i]] = n
    if string.byte(flat[i]) ~= 35 then total = total + n end  -- not '#shared', '#reserve'
  end
  local shared, reserve = held['#shared'], held['#reserve'] or 0
  if not shared then shared, reserve = fair_count_slots(queue, now) end
  return held, shared, reserve, total
end

local function fair_weight(w)
  w = tonumber(w)
  if w and w > 0 then return w end
  return 1
end

-- A flow's name: its tenant, its jobs' head start and its batch.
local function fair_flow(tenant, head_start, batch)
  return (tenant or 'default') .. '|' .. tostring(tonumber(head_start) or 0) .. '|' ..
    (batch or '')
end

-- A flow's tenant and head start (the `held` table's own entries, '#shared' and '#reserve',
-- have none).
local function fair_flow_of(flow)
  local t, p = string.match(flow, '^([^|]*)|([^|]*)|')
  return t, tonumber(p)
end

-- Whether `tenant` holds every slot of the queue held (`held`: its held table). Such a
-- tenant is never under its due (at most the shared slots), so no reserve slot is its.
local function fair_holds_all(held, tenant)
  for f, n in pairs(held) do
    local t = fair_flow_of(f)
    if n > 0 and t and t ~= tenant then return false end
  end
  return true
end

-- Give `id` (of `flow`) a slot of `queue`: its message onto the list, recorded on the
-- queue's index with the push time (popped.lua), its slot counted (and, from the reserve,
-- the farm's count of those, by tenant). `set`: more field/value pairs of the job to write
-- with its slot (a flat list, or nil). `counted`: the flow's count is right as it stands
-- (the slot was left by a job of the same flow, whose count was never lowered).
local function fair_push(queue, id, jk, flow, message, now, stage, reserve, set, counted)
  redis.call('LPUSH', queue, message)
  redis.call('ZADD', K.queued(queue), now, id)
  set = set or {}
  set[#set + 1] = 'slot'
  set[#set + 1] = queue
  redis.call('HSET', jk, unpack(set))
  if not counted then redis.call('HINCRBY', K.held(queue), flow, 1) end
  if reserve then
    redis.call('HINCRBY', K.FAIR_GIVEN, stage .. ':' .. fair_flow_of(flow) .. ':reserve', 1)
  end
end

local function stage_of(queue)
  return string.match(queue, '^([a-z]+)')
end

-- The most flows of one tenant a pick looks at (a tenant with more batches waiting than
-- this is served from some of them at a time).
local FAIR_SCAN = 128

-- Of the flows waiting (`waiting`, more than one, or a reserve slot), the one the free slot
-- goes to and its head job; nil if no tenant may have it (and true if flows found empty were
-- dropped: those beyond the scan may still wait). `held`: the queue's held table.
local function fair_choose(queue, waiting, held, shared, from_reserve)
  local theld = {}
  for f, n in pairs(held) do
    local t = fair_flow_of(f)
    if t then theld[t] = (theld[t] or 0) + n end
  end
  local tenants, flows = {}, {}
  for _, f in ipairs(waiting) do
    local t = fair_flow_of(f)
    if t then
      if not flows[t] then
        flows[t] = {}
        tenants[#tenants + 1] = t
      end
      if #flows[t] < FAIR_SCAN then flows[t][#flows[t] + 1] = f end
    end
  end
  -- The tenants holding or waiting, and their weights (none needed for one tenant waiting
  -- for a shared slot).
  local weight, sum = {}, 0
  if #tenants > 1 or from_reserve then
    local names, seen = {}, {}
    for _, t in ipairs(tenants) do names[#names + 1] = t; seen[t] = true end
    for t, n in pairs(theld) do
      if n > 0 and not seen[t] then names[#names + 1] = t end
    end
    local ws = redis.call('HMGET', K.WEIGHTS, unpack(names))
    for i, t in ipairs(names) do
      weight[t] = fair_weight(ws[i])
      sum = sum + weight[t]
    end
  end
  -- The tenant holding the fewest per weight (for a reserve slot, only one under its due);
  -- ties: the one whose earliest head came first.
  local heads, dropped = {}, false
  local best, best_ratio, best_place
  for _, t in ipairs(tenants) do
    local h, w = theld[t] or 0, weight[t] or 1
    if not from_reserve or h < shared * w / sum then
      local ratio = h / w
      if not best or ratio <= best_ratio then
        local first
        for _, f in ipairs(flows[t]) do
          local head = redis.call('ZRANGE', K.pen(queue, f), 0, 0, 'WITHSCORES')
          if #head == 0 then
            redis.call('SREM', K.pen_flows(queue), f)
            dropped = true
          else
            heads[f] = {head[1], tonumber(head[2])}
            if not first or heads[f][2] < first then first = heads[f][2] end
          end
        end
        if first and (not best or ratio < best_ratio or first < best_place) then
          best, best_ratio, best_place = t, ratio, first
        end
      end
    end
  end
  if not best then return nil, dropped end
  -- Within it: the head start of its earliest head goes now; of its flows with that head
  -- start, the one holding the fewest, then the earliest.
  local class
  for _, f in ipairs(flows[best]) do
    if heads[f] and heads[f][2] == best_place then
      local _, p = fair_flow_of(f)
      class = p
      break
    end
  end
  local flow, flow_held, flow_place
  for _, f in ipairs(flows[best]) do
    local hd = heads[f]
    local _, p = fair_flow_of(f)
    if hd and p == class then
      local n = held[f] or 0
      if not flow or n < flow_held or (n == flow_held and hd[2] < flow_place) then
        flow, flow_held, flow_place = f, n, hd[2]
      end
    end
  end
  return flow, heads[flow][1]
end

-- Hand out free slots of `queue` to waiting jobs, at most `budget`; returns how many.
-- `owed`: a flow that has just left a slot and whose count is still to be lowered by one:
-- if the slot goes back to that flow (a tenant alone with one batch), the count is left as
-- it is, neither lowered nor raised.
local function fair_pick(queue, now, budget, owed)
  local given = 0
  local stage = stage_of(queue)
  local function settle()
    if owed then redis.call('HINCRBY', K.held(queue), owed, -1) end
    owed = nil
  end
  while given < budget do
    local waiting = redis.call('SMEMBERS', K.pen_flows(queue))
    if #waiting == 0 then break end
    local held, shared, reserve, total = fair_held(queue, now)
    if owed then
      held[owed] = (held[owed] or 0) - 1
      total = total - 1
    end
    if total >= shared + reserve then break end
    local from_reserve = total >= shared
    local flow, id
    if #waiting == 1 and not from_reserve then
      -- One flow waits and a shared slot is free: its head job takes it (its pen, found
      -- empty, leaves the set of flows waiting).
      local head = redis.call('ZPOPMIN', K.pen(queue, waiting[1]))
      if #head == 0 then
        redis.call('SREM', K.pen_flows(queue), waiting[1])
        break
      end
      flow, id = waiting[1], head[1]
    else
      flow, id = fair_choose(queue, waiting, held, shared, from_reserve)
      if flow then
        -- (A pen left empty stays in the set of flows waiting until a pick finds it so.)
        redis.call('ZREM', K.pen(queue, flow), id)
      elseif not id then
        break  -- (else it dropped empty flows: look again)
      end
    end
    if flow then
      local jk = K.job(id)
      local message = redis.call('HGET', K.pen_messages(queue), id)
      redis.call('HDEL', K.pen_messages(queue), id)
      local j = redis.call('HMGET', jk, 'phase', 'queue')
      if message and j[1] == 'waiting' and j[2] == queue then
        local counted = flow == owed
        if counted then owed = nil else settle() end
        fair_push(queue, id, jk, flow, message, now, stage, from_reserve, nil, counted)
        given = given + 1
      end
    end
  end
  settle()
  return given
end

-- The job fields fair share reads, in this order (a caller that reads the job anyway
-- reads them with its own and hands them to fair_release).
local FAIR_FIELDS = {'slot', 'tenant', 'prio_s', 'batch_id'}

-- What fair_release read of a job, for fair_enter in the same script (a hand-off).
local fair_read = {}

-- The job's flow, and the queue whose slot it held when last read (or false; a blank mark
-- is none).
local function fair_fields(jk)
  local f = fair_read[jk] or redis.call('HMGET', jk, unpack(FAIR_FIELDS))
  return fair_flow(f[2], f[3], f[4]), f[1] ~= '' and f[1]
end

-- A job's place in a pen: when it came, in microseconds, less its head start; `k`: its
-- index in its submission.
local function fair_place(now, head_start, k)
  return math.floor((now - head_start) * 1e6) + k
end

-- A job now waits for a slot of `queue`: it takes one at once if one is free and nobody
-- waits for it, else it waits in its flow's pen, and the pick runs unless every slot,
-- reserve too, is held, or its tenant holds all those held.
-- (A shared slot is never free while a job waits in a pen: each way a slot frees, or slots
-- are added, runs the pick.) The job's `slot` field, left by fair_release for a hand-off,
-- is set or blanked here; `set`: the caller's own field/value pairs of the job, written with
-- it (or nil).
local function fair_enter(queue, id, jk, message, now, set)
  local flow, had = fair_fields(jk)
  local held, shared, reserve, total = fair_held(queue, now)
  if total < shared then
    fair_push(queue, id, jk, flow, message, now, stage_of(queue), false, set)
    return
  end
  local tenant, head_start = fair_flow_of(flow)
  if set then
    -- (A hand-off: the slot mark it left is blanked in the same write.)
    if had then
      set[#set + 1] = 'slot'
      set[#set + 1] = ''
    end
    redis.call('HSET', jk, unpack(set))
  elseif had then
    redis.call('HDEL', jk, 'slot')
  end
  redis.call('HSET', K.pen_messages(queue), id, message)
  redis.call('ZADD', K.pen(queue, flow), fair_place(now, head_start, 0), id)
  redis.call('SADD', K.pen_flows(queue), flow)
  -- With reserve slots free, this job may take one, unless its tenant holds every slot
  -- held (a tenant alone: its job waits for a shared slot, with no pick run for nothing).
  if total < shared + reserve and not fair_holds_all(held, tenant) then
    fair_pick(queue, now, 1)
  end
end

-- The job leaves the slot it holds, if any, and the pick hands it on. `f`: the job's
-- FAIR_FIELDS where the caller read them. `entering`: the caller calls fair_enter for the
-- job next (a hand-off), which sets or drops its `slot` field.
local function fair_release(id, jk, now, f, entering)
  f = f or redis.call('HMGET', jk, unpack(FAIR_FIELDS))
  fair_read[jk] = f
  if not f[1] or f[1] == '' then return end
  local queue, flow = f[1], fair_flow(f[2], f[3], f[4])
  if not entering then redis.call('HDEL', jk, 'slot') end
  -- (A flow's count left at 0 goes at the queue's next registration, fair_fill: one batch's
  -- jobs passing one by one through a free stage would otherwise delete and write it back
  -- for each.)
  fair_pick(queue, now, 1, flow)
end

-- The job no longer waits in a pen of `queue` (it ended or moved elsewhere).
local function fair_unpen(id, jk, queue)
  local flow = fair_fields(jk)
  local pen = K.pen(queue, flow)
  if redis.call('ZREM', pen, id) == 1 then
    redis.call('HDEL', K.pen_messages(queue), id)
    if redis.call('ZCARD', pen) == 0 then redis.call('SREM', K.pen_flows(queue), flow) end
  end
end
