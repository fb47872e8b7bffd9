"""The Lua scripts of the Redis limit store: each check or settlement is one atomic script.

They mirror ``gateway.limits.gcra`` and ``gateway.limits.memory`` line for line, and their
arithmetic is exact:

* a bucket is a hash ``{d: debt, t: ms}``, expiring once drained (plus a second); its numbers
  stay integers below 2**53 (``MAX_RATE``), exact in Lua's numbers (doubles);
* a slot set is a sorted set of lease ids scored by their expiry (ms), and so is a budget
  window's hold set (members ``<id>=<micro-dollars>``, their total the record's ``held$.u``);
* money is a pair of fields, ``<name>.u`` (whole micro-dollars) and ``<name>.p`` (the pUSD
  below one micro-dollar, kept under 10**6 by carrying); the client sends each amount already
  split the same way.

Money is never a Lua number. Micro-dollars reach 10**18 (a budget may be 10**12 USD), past
2**53, where doubles round, and Redis writes a number of 10**17 or more that a script hands it
as ``1e+17``, which ``HINCRBY`` then refuses. So amounts stay decimal strings: Redis adds them
(``HINCRBY`` with the string, exact in 64 bits: a window's spend up to about 9.2e12 USD, past
which ``HINCRBY`` refuses the settlement), the scripts return them as strings, and the budget
gate compares sums as pairs of doubles ``{high, low}`` in base 10**9 (``money``, ``plus``,
``compare``), each part exact: ``spend + held + hold`` against the cap holds even a hold far
past any cap (it is over, however it rounds).

Time is the server's (``TIME``, one clock for every instance) unless the caller passes one.
"""

from __future__ import annotations

_COMMON = """
local function now_ms(arg)
  local now = tonumber(arg)
  if now then return now end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function ceil_div(a, b)
  local q = math.floor(a / b)
  while q * b < a do q = q + 1 end
  while q > 0 and (q - 1) * b >= a do q = q - 1 end
  return q
end
local function drained(key, now, limit)
  local row = redis.call('HMGET', key, 'd', 't')
  local d, t = tonumber(row[1]) or 0, tonumber(row[2]) or now
  if now > t then d = math.max(0, d - (now - t) * limit) end
  return d, math.max(t, now)
end
-- Money (module docstring): a non-negative decimal string as {high, low} in base 10**9.
local BASE = 1000000000
local function money(text)
  if not text or string.sub(text, 1, 1) == '-' then return {0, 0} end
  local n = #text
  if n <= 9 then return {0, tonumber(text)} end
  return {tonumber(string.sub(text, 1, n - 9)), tonumber(string.sub(text, n - 8))}
end
local function plus(a, b)
  local low = a[2] + b[2]
  if low >= BASE then return {a[1] + b[1] + 1, low - BASE} end
  return {a[1] + b[1], low}
end
local function compare(a, b)
  if a[1] ~= b[1] then return a[1] < b[1] and -1 or 1 end
  if a[2] ~= b[2] then return a[2] < b[2] and -1 or 1 end
  return 0
end
local function text(a)
  if a[1] == 0 then return string.format('%d', a[2]) end
  return string.format('%d%09d', a[1], a[2])
end
-- Take ``amount`` (a positive decimal string) off a record's held total, dropped at zero.
local function unhold(rec, amount)
  if amount == '0' then return end
  if redis.call('HINCRBY', rec, 'held$.u', '-' .. amount) <= 0 then
    redis.call('HDEL', rec, 'held$.u')
  end
end
local function store(key, d, t, limit)
  if d > 0 then
    redis.call('HSET', key, 'd', d, 't', t)
    redis.call('PEXPIRE', key, ceil_div(d, limit) + 1000)
  else
    redis.call('DEL', key)
  end
end
"""

# KEYS: buckets (nb), slot sets (ns), then the budget's usage record and its hold set (when
#       ARGV[6] ~= ''), then the check's marker (when ARGV[12] ~= '').
# ARGV: now|'', nb, ns, lease id, lease ttl ms, cap micro|'', cap pUSD rest, refuse 0|1,
#       hold micro (0: none), hold member, record keep s, marker 1|'', then per bucket: limit,
#       period ms, amount; then per slot: limit, count (leases taken: 1 is the lease id itself,
#       more are ``<lease id>#0`` ... ``#count-1``, a grant).
# The marker (a key of the tenant's, one per check) says what became of a check whose answer
# may be lost: set to 1 when it admits (for the lease TTL), so ``UNDO`` gives back exactly what
# it took, once; found already there (``UNDO`` ran first: its caller gave up), the check takes
# nothing and returns -1.
# Returns: admitted, now, blocker (0, 1 bucket, 2 slot, 3 budget), index (1-based),
#          wait ms (-1: never), spend micro (a decimal string, as every amount of micro-dollars
#          returned), spend pUSD rest, over budget 0|1, held micro,
#          debts..., held leases...; or -1 (given up before it ran).
ACQUIRE = (
    _COMMON
    + """
local now = now_ms(ARGV[1])
local nb, ns = tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, ttl = ARGV[4], tonumber(ARGV[5])
local mark = ARGV[12] ~= '' and KEYS[#KEYS] or nil
if mark and redis.call('EXISTS', mark) == 1 then return -1 end
local blocker, index, wait = 0, 0, 0
local su, sp, over, hu = '0', 0, 0, '0'
local need = ARGV[9]
local rec, hk = KEYS[nb + ns + 1], KEYS[nb + ns + 2]
if ARGV[6] ~= '' then
  local row = redis.call('HMGET', rec, 'spend$.u', 'spend$.p', 'held$.u')
  su, sp, hu = row[1] or '0', tonumber(row[2]) or 0, row[3] or '0'
  if row[3] then
    -- holds their holder stopped renewing (a crashed instance) are reclaimed
    local gone = redis.call('ZRANGEBYSCORE', hk, '-inf', now)
    if #gone > 0 then
      local freed = {0, 0}
      for _, m in ipairs(gone) do freed = plus(freed, money(string.match(m, '=(%d+)$'))) end
      redis.call('ZREMRANGEBYSCORE', hk, '-inf', now)
      unhold(rec, text(freed))
    end
    hu = redis.call('HGET', rec, 'held$.u') or '0'
    if hu ~= '0' and redis.call('EXISTS', hk) == 0 then
      hu = '0'
      redis.call('HDEL', rec, 'held$.u')
    end
  end
  local spent, cap, cp = money(su), money(ARGV[6]), tonumber(ARGV[7])
  local c = compare(spent, cap)
  if c > 0 or (c == 0 and sp >= cp) then
    over = 1
  elseif need ~= '0' then
    c = compare(plus(plus(spent, money(hu)), money(need)), cap)
    if c > 0 or (c == 0 and sp > cp) then over = 1 end
  end
  if over == 1 and ARGV[8] == '1' then blocker = 3 end
end
local debts, stamps, held = {}, {}, {}
local a = 13
for i = 1, nb do
  local limit, period, amount = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local d, t = drained(KEYS[i], now, limit)
  debts[i], stamps[i] = d, t
  if blocker == 0 or blocker == 1 then
    local need = -1
    if amount <= limit then
      local excess = d + amount * period - limit * period
      need = 0
      if excess > 0 then need = ceil_div(excess, limit) end
    end
    if need ~= 0 then
      if blocker == 0 or need == -1 or (wait ~= -1 and need > wait) then
        index, wait = i, need
      end
      blocker = 1
    end
  end
end
local counts = {}
for j = 1, ns do
  local key, limit, count = KEYS[nb + j], tonumber(ARGV[a]), tonumber(ARGV[a + 1])
  a = a + 2
  counts[j] = count
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  held[j] = redis.call('ZCARD', key)
  if blocker == 0 and held[j] + count > limit then blocker, index = 2, j end
end
if blocker == 0 then
  a = 13
  for i = 1, nb do
    local limit, period, amount = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
    a = a + 3
    debts[i] = debts[i] + amount * period
    store(KEYS[i], debts[i], stamps[i], limit)
  end
  for j = 1, ns do
    if counts[j] == 1 then
      redis.call('ZADD', KEYS[nb + j], now + ttl, lease)
    else
      local pairs = {}
      for n = 0, counts[j] - 1 do
        pairs[#pairs + 1] = now + ttl
        pairs[#pairs + 1] = lease .. '#' .. n
      end
      redis.call('ZADD', KEYS[nb + j], unpack(pairs))
    end
    redis.call('PEXPIRE', KEYS[nb + j], ttl + 1000)
    held[j] = held[j] + counts[j]
  end
  if need ~= '0' and over == 0 and ARGV[6] ~= '' then
    redis.call('ZADD', hk, now + ttl, ARGV[10])
    redis.call('PEXPIRE', hk, ttl + 1000)
    redis.call('HINCRBY', rec, 'held$.u', need)
    hu = redis.call('HGET', rec, 'held$.u')
    if redis.call('TTL', rec) < 0 then redis.call('EXPIRE', rec, tonumber(ARGV[11])) end
  end
  if mark then redis.call('SET', mark, 1, 'PX', math.max(ttl, 1000)) end
end
local out = {blocker == 0 and 1 or 0, now, blocker, index, wait, su, sp, over, hu}
for i = 1, nb do out[#out + 1] = debts[i] end
for j = 1, ns do out[#out + 1] = held[j] end
return out
"""
)

# KEYS: adjusted buckets (na), slot sets to leave (nr), per hold released (nh): its record and
#       its hold set, then usage records, then the settlement's done key (when ARGV[5] ~= '').
# ARGV: now|'', na, nr, lease ids (space-separated), settlement id|'', group count, nh, then
#       per bucket: limit, period ms, delta; then per hold: member, micro; then per group of
#       records sharing their fields (a request's day, week and month): record count, each
#       record's keep s, field count, then per field: name, value (money: micro), pUSD rest.
# Returns: per record, its spend: micro, pUSD rest; or -1 when this id has run already.
SETTLE = (
    _COMMON
    + """
local now = now_ms(ARGV[1])
local na, nr = tonumber(ARGV[2]), tonumber(ARGV[3])
local lease = ARGV[4]
if ARGV[5] ~= '' then
  if not redis.call('SET', KEYS[#KEYS], 1, 'NX', 'EX', 3600) then return -1 end
end
local groups, nh = tonumber(ARGV[6]), tonumber(ARGV[7])
local a = 8
for i = 1, na do
  local limit, period, delta = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local d, t = drained(KEYS[i], now, limit)
  store(KEYS[i], math.max(0, d + delta * period), t, limit)
end
if nr > 0 then
  local leases = {}
  for id in string.gmatch(lease, '%S+') do leases[#leases + 1] = id end
  if #leases > 0 then
    for j = 1, nr do redis.call('ZREM', KEYS[na + j], unpack(leases)) end
  end
end
for h = 1, nh do
  -- a hold still in its set leaves it and the total, once (reclaimed or released: nothing)
  local rec, hk = KEYS[na + nr + 2 * h - 1], KEYS[na + nr + 2 * h]
  if redis.call('ZREM', hk, ARGV[a]) == 1 then unhold(rec, ARGV[a + 1]) end
  a = a + 2
end
local out = {}
local k = na + nr + 2 * nh
for g = 1, groups do
  local records = tonumber(ARGV[a])
  local keeps = a + 1
  local nf = tonumber(ARGV[keeps + records])
  local fields = keeps + records + 1
  a = fields + 3 * nf
  for r = 1, records do
    k = k + 1
    local key = KEYS[k]
    for f = 0, nf - 1 do
      local at = fields + 3 * f
      local name, hi, lo = ARGV[at], ARGV[at + 1], ARGV[at + 2]
      if string.sub(name, -1) == '$' then
        -- hi: micro-dollars, a decimal string (module docstring); lo: pUSD under 10**6
        local rest = redis.call('HINCRBY', key, name .. '.p', lo)
        local carry = math.floor(rest / 1000000)
        if hi ~= '0' then redis.call('HINCRBY', key, name .. '.u', hi) end
        if carry > 0 then
          redis.call('HINCRBY', key, name .. '.p', -carry * 1000000)
          redis.call('HINCRBY', key, name .. '.u', carry)
        end
      elseif hi ~= '0' then
        redis.call('HINCRBY', key, name, hi)
      end
    end
    redis.call('EXPIRE', key, tonumber(ARGV[keeps + r - 1]))
    local row = redis.call('HMGET', key, 'spend$.u', 'spend$.p')
    out[#out + 1] = row[1] or '0'
    out[#out + 1] = row[2] or '0'
  end
end
return out
"""
)

# Gives back what one check took, once, when its answer was lost (its caller timed out or
# left): ``ACQUIRE``'s marker says whether it admitted. Marker 1: the tokens and requests go
# back to the buckets, its leases (a grant's too) and its budget hold are released, the marker
# becomes 0 (sent again: nothing). No marker: the check has not run (or was refused); the
# marker is set to 0 so that, should it reach Redis later, it takes nothing.
# KEYS: the marker, buckets (nb), slot sets (ns), then the hold's record and hold set (when
#       ARGV[6] ~= '').
# ARGV: now|'', nb, ns, lease ids (space-separated), marker ttl ms, hold member|'', hold micro,
#       then per bucket: limit, period ms, amount.
# Returns: 1 given back, 0 nothing to give back.
UNDO = (
    _COMMON
    + """
local now = now_ms(ARGV[1])
local nb, ns = tonumber(ARGV[2]), tonumber(ARGV[3])
local mark = KEYS[1]
local state = redis.call('GET', mark)
local keep = math.max(tonumber(ARGV[5]), 1000)
if state ~= '1' then
  if not state then redis.call('SET', mark, 0, 'PX', keep) end
  return 0
end
redis.call('SET', mark, 0, 'PX', keep)
local a = 8
for i = 1, nb do
  local limit, period, amount = tonumber(ARGV[a]), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  a = a + 3
  local d, t = drained(KEYS[1 + i], now, limit)
  store(KEYS[1 + i], math.max(0, d - amount * period), t, limit)
end
local leases = {}
for id in string.gmatch(ARGV[4], '%S+') do leases[#leases + 1] = id end
if #leases > 0 then
  for j = 1, ns do redis.call('ZREM', KEYS[1 + nb + j], unpack(leases)) end
end
if ARGV[6] ~= '' then
  local rec, hk = KEYS[2 + nb + ns], KEYS[3 + nb + ns]
  if redis.call('ZREM', hk, ARGV[6]) == 1 then unhold(rec, ARGV[7]) end
end
return 1
"""
)

# What the usage report reads: the record's fields, its ``held$`` taken from the holds still
# live (an expired hold, its holder gone, is reclaimed from the total only by the next check).
# KEYS: the usage record, its hold set; ARGV: now|''.
# Returns: the record's fields and values, flat, then the micro-dollars the live holds hold.
READ = (
    _COMMON
    + """
local now = now_ms(ARGV[1])
local out = redis.call('HGETALL', KEYS[1])
local held = {0, 0}
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')) do
  held = plus(held, money(string.match(m, '=(%d+)$')))
end
out[#out + 1] = text(held)
return out
"""
)

# KEYS: slot sets; ARGV: now|'', ttl ms, then the lease id held in each set.
RENEW = (
    _COMMON
    + """
local now, ttl = now_ms(ARGV[1]), tonumber(ARGV[2])
for i = 1, #KEYS do
  local score = redis.call('ZSCORE', KEYS[i], ARGV[2 + i])
  if score and tonumber(score) > now then
    redis.call('ZADD', KEYS[i], now + ttl, ARGV[2 + i])
    redis.call('PEXPIRE', KEYS[i], ttl + 1000)
  end
end
return #KEYS
"""
)
