-- lib jobs: what every job script shares.
-- uses: backends, metrics

local function now_s()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local function fmt(x) return string.format('%.6f', x) end

-- Move a job to another state, keeping its batch's per-state counters exact.
local function set_state(jk, old, new, batch)
  if old == new then return end
  redis.call('HSET', jk, 'state', new)
  local ck = K.batch_counts(batch)
  redis.call('HINCRBY', ck, old, -1)
  redis.call('HINCRBY', ck, new, 1)
  redis.call('HINCRBY', K.STATE_COUNTS, old, -1)
  redis.call('HINCRBY', K.STATE_COUNTS, new, 1)
end

-- A stage's active time, from its start field, into the stage's histogram.
local function observe_active(jk, stage, now)
  local start = redis.call('HGET', jk, 't_' .. stage .. '_start')
  if start then observe('active:' .. stage, now - tonumber(start)) end
end

-- A stage message pushed by the script that moved its job: on its queue, recorded as
-- published (for the reaper's lost-message test), and no heartbeat left to go stale.
local function push_message(queue, id, message, now)
  redis.call('LPUSH', queue, message)
  redis.call('ZREM', K.ACTIVE, id)
  redis.call('ZADD', K.published(queue), now, id)
end

-- Drop a job from the indexes of the queue it waits on.
local function unqueue(id, queue)
  if queue and queue ~= '' then
    redis.call('ZREM', K.queued(queue), id)
    redis.call('ZREM', K.published(queue), id)
  end
end

-- The one way into a terminal state. Returns "<old state>:<old phase>:<old token>".
local function finish(id, jk, state, kind, msg, ttl, now)
  local j = redis.call('HMGET', jk, 'state', 'stage', 'phase', 'batch_id', 'queue', 'token',
                       'instance_id', 'sampling_id')
  local old, stage, phase, batch, queue, token, inst = j[1], j[2], j[3], j[4], j[5], j[6], j[7]
  if phase == 'active' then
    redis.call('HSET', jk, 't_' .. stage .. '_end', fmt(now))
    observe_active(jk, stage, now)
  end
  redis.call('HSET', jk, 'phase', 'end', 'finished_at', fmt(now))
  if kind ~= '' then
    redis.call('HSET', jk, 'failure_kind', kind, 'failure_message', msg)
    if state == 'failed' then redis.call('HINCRBY', K.FAILURE_KINDS, kind, 1) end
  end
  set_state(jk, old, state, batch)
  release_backend(id)
  redis.call('XADD', K.batch_stream(batch), '*', 'job', id, 'state', state)
  redis.call('ZREM', K.ACTIVE, id)
  redis.call('ZREM', K.DEADLINES, id)
  unqueue(id, queue)
  redis.call('HINCRBY', K.STATS, state, 1)
  redis.call('EXPIRE', jk, ttl)
  if inst then redis.call('EXPIRE', K.instance(inst), ttl) end
  if j[8] then redis.call('EXPIRE', K.sampling(j[8]), ttl) end
  for _, k in ipairs({K.batch(batch), K.batch_counts(batch), K.batch_stream(batch),
                      K.batch_jobs(batch)}) do
    redis.call('EXPIRE', k, ttl)
  end
  return old .. ':' .. phase .. ':' .. (token or '')
end
