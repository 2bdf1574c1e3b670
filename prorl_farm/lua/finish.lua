-- finish: a job's terminal transition.
-- uses: jobs
-- KEYS: (none)
-- ARGV: job, token, state, kind, message, ttl_s, fields...
--   token: '' = any attempt; else only from that active attempt. fields: field, value,
--   ... to set first.
-- returns: 'ok:<old state>:<old phase>:<old token>' | 'terminal:<state>' | 'stale' |
--   'missing'

local id, token, state, kind, msg, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
local jk = K.job(id)
local j = finish_read(jk)
if not j[1] then return 'missing' end
if TERMINAL[j[1]] then return 'terminal:' .. j[1] end
if token ~= '' and (j[6] ~= token or j[3] ~= 'active') then return 'stale' end
if token == '' then signal_holder(jk) end  -- not the holder's own end
local extra = {}
for i = 7, #ARGV do extra[#extra + 1] = ARGV[i] end
return 'ok:' .. finish(id, jk, state, kind, msg, ttl, now_s(), extra, j)
