-- leave_sweep: a pool leaving its node (lua/reap.lua's 'leave') reads, in one step, every
-- job waiting on its queue: those whose message is on the list (the queue's index) and
-- those in its pens. Read in two steps, a slot freed between them moved a pen job onto the
-- list, and it was in neither read. With `mark`, the queue is also marked left (K.LEFT,
-- queue -> when) so that the reaper hands back, at its next look, what enters the queue
-- after this read (a stage that finished on the node while its pools stopped); a pool that
-- registers slots of the queue again (lua/fair_fill.lua) clears the mark.
-- uses: jobs
-- KEYS: (none)
-- ARGV: queue, mark, limit
--   mark: 1 marks the queue left. limit: the most jobs read.
-- returns: flat job, token pairs: each job waiting on the queue (list or pens)

local queue, mark, limit = ARGV[1], ARGV[2] == '1', tonumber(ARGV[3])
if mark then redis.call('HSET', K.LEFT, queue, fmt(now_s())) end
local ids = redis.call('ZRANGE', K.queued(queue), 0, limit - 1)
for _, flow in ipairs(redis.call('SMEMBERS', K.pen_flows(queue))) do
  if #ids >= limit then break end
  for _, id in ipairs(redis.call('ZRANGE', K.pen(queue, flow), 0, limit - #ids - 1)) do
    ids[#ids + 1] = id
  end
end
local out = {}
for _, id in ipairs(ids) do
  local j = redis.call('HMGET', K.job(id), 'token', 'phase', 'queue')
  if j[1] and j[2] == 'waiting' and j[3] == queue then
    out[#out + 1] = id
    out[#out + 1] = j[1]
  end
end
return out
