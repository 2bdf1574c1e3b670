-- lib jobs: what every job script shares.
-- uses: backends, metrics, fair

local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end

-- Count a job's move to another state in its batch's counter array (one BITFIELD) and the
-- farm's per-state counters (the caller writes the state itself, in its own HSET of the
-- job). `tenant`: the job's (its batch's), where the caller read it.
local function count_state(old, new, batch, tenant)
  if old == new then return end
  redis.call('BITFIELD', K.batch_counts(batch), 'INCRBY', 'i64', '#' .. STATE_SLOT[old], -1,
             'INCRBY', 'i64', '#' .. STATE_SLOT[new], 1)
  redis.call('HINCRBY', K.STATE_COUNTS, old, -1)
  redis.call('HINCRBY', K.STATE_COUNTS, new, 1)
  -- The batch's tenant's usage (prorl_farm/tenants.py).
  tenant = tenant or redis.call('HGET', K.batch(batch), 'tenant')
  if tenant then
    redis.call('HINCRBY', K.tenant(tenant), old, -1)
    redis.call('HINCRBY', K.tenant(tenant), new, 1)
  end
end

-- A stage's active time, from its start time (a field's value, or false), into the stage's
-- histogram.
local function observe_active(stage, start, now)
  if start then observe('active:' .. stage, now - tonumber(start)) end
end

-- A stage message of the script that moved its job: pushed on its queue when the job gets a
-- slot there (lib/fair.lua; recorded with the time of the push, for the reaper's
-- lost-message test), kept in the job's pen until then; no heartbeat left to go stale.
local function push_message(queue, id, message, now, set)
  redis.call('ZREM', K.ACTIVE, id)
  fair_enter(queue, id, K.job(id), message, now, set)
end

-- Drop a job from the queue it waits on: its index, or its pen.
local function unqueue(id, queue)
  if queue and queue ~= '' then
    if redis.call('ZREM', K.queued(queue), id) == 0 then fair_unpen(id, K.job(id), queue) end
  end
end

-- A job taken from the worker process holding it (cancelled, failed at its deadline,
-- re-queued): the holder's K.moved counter is bumped, so its next tick beats its jobs at
-- once and learns which to abort (worker/liveness.py beats them in full only every few
-- seconds otherwise).
local function signal_holder(jk)
  local holder = redis.call('HGET', jk, 'holder')
  if holder and holder ~= '' then
    redis.call('INCR', K.moved(holder))
    redis.call('EXPIRE', K.moved(holder), 86400)
  end
end

-- What a terminal transition reads of its job (finish_read), in this order.
local function finish_read(jk)
  return redis.call('HMGET', jk, 'state', 'stage', 'phase', 'batch_id', 'queue', 'token',
                    'instance_id', 'sampling_id', 'deadline_at', 't_init_start',
                    't_run_start', 't_eval_start', 'backend', 'slot', 'tenant', 'prio_s')
end

-- The one way into a terminal state; ``extra``: more field/value pairs to set (a flat
-- list); ``j``: finish_read's reply where the caller has it. Returns "<old state>:<old
-- phase>:<old token>".
local function finish(id, jk, state, kind, msg, ttl, now, extra, j)
  j = j or finish_read(jk)
  local old, stage, phase, batch, queue, token = j[1], j[2], j[3], j[4], j[5], j[6]
  local set = extra or {}
  for _, v in ipairs({'state', state, 'phase', 'end', 'finished_at', fmt(now)}) do
    set[#set + 1] = v
  end
  if phase == 'active' then
    set[#set + 1] = 't_' .. stage .. '_end'
    set[#set + 1] = fmt(now)
    observe_active(stage, j[({init = 10, run = 11, eval = 12})[stage]], now)
  end
  if kind ~= '' then
    for _, v in ipairs({'failure_kind', kind, 'failure_message', msg}) do
      set[#set + 1] = v
    end
    if state == 'failed' then redis.call('HINCRBY', K.FAILURE_KINDS, kind, 1) end
  end
  redis.call('HSET', jk, unpack(set))
  count_state(old, state, batch, j[15])
  if phase == 'waiting' then unqueue(id, queue) end
  fair_release(id, jk, now, {j[14], j[15], j[16], batch})
  local hist = {'ended:' .. state, 1}
  if state == 'failed' and kind ~= '' then
    hist[#hist + 1] = 'failed:' .. kind
    hist[#hist + 1] = 1
  end
  for i = 1, #set - 1, 2 do
    if set[i] == 'reward' and state == 'done' and tonumber(set[i + 1]) then
      local r = tonumber(set[i + 1])
      for _, v in ipairs({'reward_sum', r, 'reward_n', 1, 'pass_n', r >= 1 and 1 or 0}) do
        hist[#hist + 1] = v
      end
    end
  end
  history(now, hist)
  release_backend(id, j[13])
  redis.call('XADD', K.batch_stream(batch), '*', 'job', id, 'state', state)
  redis.call('ZREM', K.ACTIVE, id)
  if j[9] and j[9] ~= '' then redis.call('ZREM', K.DEADLINES, id) end
  redis.call('EXPIRE', jk, ttl)
  if j[7] then redis.call('EXPIRE', K.instance(j[7]), ttl) end
  if j[8] then redis.call('EXPIRE', K.sampling(j[8]), ttl) end
  -- The batch's keys expire ttl after its last job ended (a later submission to the same
  -- batch makes them persist again).
  if redis.call('HINCRBY', K.batch(batch), 'left', -1) <= 0 then
    for _, k in ipairs({K.batch(batch), K.batch_counts(batch), K.batch_stream(batch),
                        K.batch_jobs(batch)}) do
      redis.call('EXPIRE', k, ttl)
    end
  end
  return old .. ':' .. phase .. ':' .. (token or '')
end
