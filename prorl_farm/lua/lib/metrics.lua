-- lib metrics: observe a value into a histogram of the fixed BUCKETS; count into the
-- dashboard's per-minute history (prorl_farm/history.py).

local function observe(name, v)
  if v < 0 then v = 0 end
  local i = #BUCKETS + 1
  for b = 1, #BUCKETS do
    if v <= BUCKETS[b] then i = b break end
  end
  -- A counter array: bucket i at slot i - 1, the sum in microseconds at SUM_SLOT.
  redis.call('BITFIELD', K.histogram(name), 'INCRBY', 'i64', '#' .. (i - 1), 1,
             'INCRBY', 'i64', '#' .. SUM_SLOT, string.format('%d', math.floor(v * 1e6 + 0.5)))
end

-- Add each (field, amount) pair to the history of the minute holding ``now``. The minute's
-- key gets its expiry when a call creates a field there (the call that creates the key
-- does), not at every call.
local function history(now, pairs)
  local hk = K.history(string.format('%d', math.floor(now / HISTORY_STEP_S) * HISTORY_STEP_S))
  local new = false
  for i = 1, #pairs, 2 do
    local amount = pairs[i + 1]
    local total = redis.call('HINCRBYFLOAT', hk, pairs[i], amount)
    if tonumber(total) == tonumber(amount) then new = true end
  end
  if new then redis.call('EXPIRE', hk, HISTORY_TTL_S) end
end
