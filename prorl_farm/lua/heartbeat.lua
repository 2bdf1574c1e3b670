-- heartbeat: refresh the heartbeat of the jobs a worker holds (reserved or running), and
-- record which process holds each (holder: its presence name, see worker/liveness.py).
-- uses: jobs
-- KEYS: (none)
-- ARGV: holder, pairs...
--   pairs: job, token, job, token, ...
-- returns: the flat job/token pairs the worker must abort: the job is gone, terminal, or
--   has moved on to another attempt

local now = now_s()
local holder = ARGV[1]
local abort = {}
for i = 2, #ARGV, 2 do
  local id, tok = ARGV[i], ARGV[i + 1]
  local jk = K.job(id)
  local j = redis.call('HMGET', jk, 'state', 'token', 'holder')
  if j[1] and not TERMINAL[j[1]] and j[2] == tok then
    redis.call('ZADD', K.ACTIVE, now, id)
    if j[3] ~= holder then redis.call('HSET', jk, 'holder', holder) end
  else
    abort[#abort + 1] = id
    abort[#abort + 1] = tok
  end
end
return abort
