-- lib metrics: observe a value into a histogram of the fixed BUCKETS.

local function observe(name, v)
  if v < 0 then v = 0 end
  local i = #BUCKETS + 1
  for b = 1, #BUCKETS do
    if v <= BUCKETS[b] then i = b break end
  end
  local hk = K.histogram(name)
  redis.call('HINCRBY', hk, 'b' .. i, 1)
  redis.call('HINCRBYFLOAT', hk, 'sum', string.format('%.6f', v))
end
