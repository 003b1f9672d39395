//! The Lua scripts: one per operation, each atomic on the server.
//!
//! Layout of one lock (all keys share the hash tag `{key}`, so one cluster slot;
//! `P` is the prefix):
//!
//! | key | type | content |
//! |---|---|---|
//! | `P{key}` | string | an exclusive hold: `"<owner>\t<holds>\t<token>"`, expiring with the key (`PX`) |
//! | `P{key}` | hash | shared or semaphore holds: `\tm` → mode; `<owner>` → `"<holds> <token>"` |
//! | `P{key}:exp` | sorted set | shared and semaphore holders: `<owner>` → expiry (server ms), so they expire one by one |
//! | `P{key}:fence` | string | the last token; never expires |
//! | `P{key}:q` | sorted set | exclusive waiters in line: `<owner>` → arrival (server µs) |
//! | `P{key}:qe` | sorted set | the same waiters → when their place lapses (server ms) |
//! | `P{key}:ch` | channel | `free` / `permit` when waiters may proceed |
//! | `P{key}:latch:<id>` | string | the answer of a partial release `<id>`, for its retry |
//!
//! The type of `P{key}` tells the mode at a glance (`TYPE`: none, string, hash),
//! which keeps the exclusive path — the common one — to a handful of commands.
//! Owners cannot contain control characters, so tabs never clash.
//!
//! The line makes exclusive waiting fair across processes: while it is not
//! empty, a free lock goes only to its first live waiter (a release PUBLISHes,
//! every waiter asks, the first wins). A release that hands the lock to the
//! next waiter of its own process (`next_owner`) does not free it; the core
//! bounds such handoffs to 16 in a row, then releases plainly. A waiter keeps its place by asking
//! again before its place lapses; one that died or gave up without leaving
//! blocks the line until then. Reentrant acquires skip it; shared and
//! semaphore requests do not stand in it but are refused while anyone does, so
//! a stream of readers cannot starve a waiting writer.
//!
//! Tokens: `max(last + 1, server time in µs, proposal)`. The time floor keeps
//! tokens rising even if the fence key is lost (Redis restarted empty, a failover
//! to a replica that missed the last writes), provided the server clock does not
//! step back across that event and a key sees fewer than one grant per
//! microsecond. The proposal (0 for a single Redis) lets Redlock's instances
//! agree on one token in the same round trip (see the `redlock` module).

use std::sync::LazyLock;

use redis::Script;

/// Shared prologue: server time, token minting, purge and upkeep of shared
/// holders (who expire one by one in the sorted set).
macro_rules! prologue {
    () => {
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function mint(F, proposal)
  local floor = math.max(tonumber(t[1]) * 1000000 + tonumber(t[2]), tonumber(proposal) or 0)
  local token = string.format('%.0f', floor)
  local prev = redis.call('SET', F, token, 'GET')
  if prev and tonumber(prev) >= floor then
    token = string.format('%.0f', tonumber(prev) + 1)
    redis.call('SET', F, token)
  end
  return token
end
local function purge(H, Z)
  local gone = redis.call('ZRANGEBYSCORE', Z, '-inf', now)
  for i = 1, #gone do redis.call('HDEL', H, gone[i]) end
  if #gone > 0 then redis.call('ZREMRANGEBYSCORE', Z, '-inf', now) end
  return redis.call('ZCARD', Z)
end
local function keep_alive(H, Z)
  local last = redis.call('ZRANGE', Z, -1, -1, 'WITHSCORES')
  if last[2] then
    local left = tonumber(last[2]) - now
    if left < 1 then left = 1 end
    redis.call('PEXPIRE', H, left)
    redis.call('PEXPIRE', Z, left)
  end
end
local function exclusive(v)
  return string.match(v, '^(.*)\t(%d+)\t(%d+)$')
end
local function unqueue(Q, QE, who)
  if redis.call('ZREM', Q, who) == 1 then redis.call('ZREM', QE, who) end
end
"
    };
}

/// KEYS: H, Z, F, Q, QE. ARGV: owner, mode, ttl_ms, reentrant (1/0), permits,
/// proposal (a floor for a new token; 0 for none), queue_ms (an exclusive
/// request that is refused stands in line for that long; 0: it does not).
/// Returns `{1, token, holds}` granted, `{0, ms_until_first_expiry}` busy,
/// `{-1, held_mode}` when the owner holds the key in another mode.
pub(crate) static ACQUIRE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prologue!(),
        r"
local H, Z, F, Q, QE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local owner, mode, ttl, reentrant, permits = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local queue_ms = tonumber(ARGV[7])
local lined = redis.call('EXISTS', Q) == 1
-- Refused: stand in line (or keep the place) if asked to, and say how long to wait.
local function refuse(wait_ms)
  if mode == 'exclusive' and queue_ms > 0 then
    redis.call('ZADD', Q, 'NX', tonumber(t[1]) * 1000000 + tonumber(t[2]), owner)
    redis.call('ZADD', QE, now + queue_ms, owner)
    local last = redis.call('ZRANGE', QE, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', Q, tonumber(last[2]) - now)
    redis.call('PEXPIRE', QE, tonumber(last[2]) - now)
  end
  return {0, wait_ms}
end
-- A new grant waits for the live waiters in line: an exclusive one unless it
-- is first, a shared or semaphore one while anyone stands there.
local function ahead()
  if not lined then return nil end
  local lapsed = redis.call('ZRANGEBYSCORE', QE, '-inf', now)
  for i = 1, #lapsed do redis.call('ZREM', Q, lapsed[i]) end
  if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', QE, '-inf', now) end
  local first = redis.call('ZRANGE', Q, 0, 0)[1]
  if first == nil or (first == owner and mode == 'exclusive') then return nil end
  return tonumber(redis.call('ZSCORE', QE, first)) - now
end
local function granted(token, holds)
  if lined then unqueue(Q, QE, owner) end
  return {1, token, holds}
end
local kind = redis.call('TYPE', H)['ok']
if kind == 'none' then
  local wait = ahead()
  if wait then return refuse(wait) end
  local token = mint(F, ARGV[6])
  if mode == 'exclusive' then
    redis.call('SET', H, owner .. '\t1\t' .. token, 'PX', ttl)
  else
    redis.call('DEL', Z)
    redis.call('HSET', H, '\tm', mode, owner, '1 ' .. token)
    redis.call('ZADD', Z, now + ttl, owner)
    keep_alive(H, Z)
  end
  return granted(token, 1)
end
if kind == 'string' then
  local holder, holds, token = exclusive(redis.call('GET', H))
  if holder ~= owner then return refuse(redis.call('PTTL', H)) end
  if mode ~= 'exclusive' then return {-1, 'exclusive'} end
  holds = tonumber(holds)
  if reentrant == '1' then
    holds = holds + 1
    redis.call('SET', H, owner .. '\t' .. holds .. '\t' .. token, 'KEEPTTL')
  end
  if redis.call('PTTL', H) < ttl then redis.call('PEXPIRE', H, ttl) end
  return {1, token, holds}
end
-- Shared or semaphore holders, each with its own expiry.
local held = redis.call('HGET', H, '\tm') or ''
local n = purge(H, Z)
if n == 0 then
  local wait = ahead()
  if wait then return refuse(wait) end
  redis.call('DEL', H, Z)
  local token = mint(F, ARGV[6])
  if mode == 'exclusive' then
    redis.call('SET', H, owner .. '\t1\t' .. token, 'PX', ttl)
  else
    redis.call('HSET', H, '\tm', mode, owner, '1 ' .. token)
    redis.call('ZADD', Z, now + ttl, owner)
    keep_alive(H, Z)
  end
  return granted(token, 1)
end
local mine = redis.call('HGET', H, owner)
if mine then
  if held ~= mode then return {-1, held} end
  local holds, token = string.match(mine, '^(%d+) (%d+)$')
  holds = tonumber(holds)
  if reentrant == '1' then
    holds = holds + 1
    redis.call('HSET', H, owner, holds .. ' ' .. token)
  end
  redis.call('ZADD', Z, math.max(tonumber(redis.call('ZSCORE', Z, owner) or '0'), now + ttl), owner)
  keep_alive(H, Z)
  return {1, token, holds}
end
local ok = (mode == 'shared' and held == 'shared')
  or (string.sub(mode, 1, 10) == 'semaphore:' and string.sub(held, 1, 10) == 'semaphore:' and n < permits)
if not ok then
  local first = redis.call('ZRANGE', Z, 0, 0, 'WITHSCORES')
  return refuse(tonumber(first[2]) - now)
end
local wait = ahead()
if wait then return refuse(wait) end
local token = mint(F, ARGV[6])
redis.call('HSET', H, owner, '1 ' .. token)
redis.call('ZADD', Z, now + ttl, owner)
keep_alive(H, Z)
return {1, token, 1}
"
    ))
});

/// KEYS: H1, Z1, H2, Z2, …  ARGV: owner1, ttl1_ms, owner2, ttl2_ms, …
/// Returns one 1 (renewed) or 0 (not held) per lease. Never re-creates a hold.
pub(crate) static RENEW: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prologue!(),
        r"
local out = {}
for i = 1, #KEYS, 2 do
  local H, Z = KEYS[i], KEYS[i + 1]
  local owner, ttl = ARGV[i], tonumber(ARGV[i + 1])
  local kind = redis.call('TYPE', H)['ok']
  local ok = 0
  if kind == 'string' then
    if exclusive(redis.call('GET', H)) == owner then
      redis.call('PEXPIRE', H, ttl)
      ok = 1
    end
  elseif kind == 'hash' then
    if redis.call('HEXISTS', H, owner) == 1 and tonumber(redis.call('ZSCORE', Z, owner) or '0') > now then
      redis.call('ZADD', Z, now + ttl, owner)
      keep_alive(H, Z)
      ok = 1
    end
  end
  out[#out + 1] = ok
end
return out
"
    ))
});

/// KEYS: H, Z, latch, F, Q, QE. ARGV: owner, channel, latch_ttl_ms, retry (1/0),
/// next_owner ('' for none), next_ttl_ms, proposal (floor of the next token).
///
/// Returns `{holds_left, handed_token}`: `holds_left` is -1 when the owner holds
/// nothing, else the holds left (0: let go). When an exclusive lock is let go
/// and `next_owner` is given, the lock passes to `next_owner` in the same step
/// (new token, no window for anybody else) and `handed_token` is its token;
/// otherwise `handed_token` is 0 and waiters are told on the channel.
///
/// A partial release (reentrant holds remain) records its answer under the
/// latch key; a retry (after a lost reply) returns that answer instead of
/// releasing twice, and a retry that finds the owner gone reports 0, since the
/// first attempt let go (it never touches another owner's hold).
pub(crate) static RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(concat!(
        prologue!(),
        r"
local H, Z, L, F = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, channel, retry, next_owner = ARGV[1], ARGV[2], ARGV[4] == '1', ARGV[5]
if retry then
  local prev = redis.call('GET', L)
  if prev then return {tonumber(prev), 0} end
end
local kind = redis.call('TYPE', H)['ok']
if kind == 'string' then
  local holder, holds, token = exclusive(redis.call('GET', H))
  if holder == owner then
    holds = tonumber(holds) - 1
    if holds > 0 then
      redis.call('SET', H, owner .. '\t' .. holds .. '\t' .. token, 'KEEPTTL')
      redis.call('SET', L, holds, 'PX', ARGV[3])
      return {holds, 0}
    end
    if next_owner ~= '' then
      local next_token = mint(F, ARGV[7])
      redis.call('SET', H, next_owner .. '\t1\t' .. next_token, 'PX', ARGV[6])
      unqueue(KEYS[5], KEYS[6], next_owner)
      return {0, next_token}
    end
    redis.call('DEL', H)
    redis.call('PUBLISH', channel, 'free')
    return {0, 0}
  end
elseif kind == 'hash' then
  local mine = redis.call('HGET', H, owner)
  if mine and tonumber(redis.call('ZSCORE', Z, owner) or '0') > now then
    local holds, token = string.match(mine, '^(%d+) (%d+)$')
    holds = tonumber(holds) - 1
    if holds > 0 then
      redis.call('HSET', H, owner, holds .. ' ' .. token)
      redis.call('SET', L, holds, 'PX', ARGV[3])
      return {holds, 0}
    end
    redis.call('HDEL', H, owner)
    redis.call('ZREM', Z, owner)
    if redis.call('ZCARD', Z) == 0 then
      redis.call('DEL', H, Z)
      redis.call('PUBLISH', channel, 'free')
    elseif string.sub(redis.call('HGET', H, '\tm') or '', 1, 10) == 'semaphore:' then
      redis.call('PUBLISH', channel, 'permit')
    end
    return {0, 0}
  end
end
if retry then return {0, 0} end
return {-1, 0}
"
    ))
});

/// KEYS: Q, QE, H. ARGV: owner, channel. Takes `owner` out of the line (a
/// waiter that gave up); if it was first, wakes the waiters it held up (the
/// next writer if the lock is free, readers refused while it stood there).
pub(crate) static LEAVE_LINE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local first = redis.call('ZRANK', KEYS[1], ARGV[1]) == 0
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
if first then redis.call('PUBLISH', ARGV[2], 'free') end
return 1
",
    )
});

/// KEYS: H, Z, F. Returns `{now_ms, fence, kind, holders, expiries, pttl}` where
/// `holders` is `{owner, "<holds> <token>", …}` plus `\tm` → mode for a hash,
/// or the exclusive value for a string.
pub(crate) static INSPECT: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local kind = redis.call('TYPE', KEYS[1])['ok']
local holders = {}
if kind == 'string' then
  holders = {redis.call('GET', KEYS[1])}
elseif kind == 'hash' then
  holders = redis.call('HGETALL', KEYS[1])
end
return {now, redis.call('GET', KEYS[3]) or '', kind, holders,
        redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf', 'WITHSCORES'), redis.call('PTTL', KEYS[1])}
",
    )
});

/// KEYS: H, Z. ARGV: channel. Deletes every hold (the fence stays) and wakes waiters.
pub(crate) static FORCE_RELEASE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local n = redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', ARGV[1], 'free')
return n
",
    )
});

/// KEYS: resource hash. ARGV: token, value. Writes `value` and records `token`
/// unless the resource has seen a larger token. Returns 1 written, 0 rejected.
pub(crate) static FENCED_SET: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local seen = redis.call('HGET', KEYS[1], 'token')
if seen and tonumber(seen) > tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
return 1
",
    )
});

/// KEYS: H, F. ARGV: owner, token. Raises the fence to at least `token` and
/// records `token` as the owner's (Redlock's quorum max-register write).
pub(crate) static RAISE_FENCE: LazyLock<Script> = LazyLock::new(|| {
    Script::new(
        r"
local token = ARGV[2]
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(token) then
  redis.call('SET', KEYS[2], token)
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'string' then
  local holder, holds = string.match(redis.call('GET', KEYS[1]), '^(.*)\t(%d+)\t(%d+)$')
  if holder == ARGV[1] then
    redis.call('SET', KEYS[1], holder .. '\t' .. holds .. '\t' .. token, 'KEEPTTL')
  end
elseif kind == 'hash' then
  local mine = redis.call('HGET', KEYS[1], ARGV[1])
  if mine then
    redis.call('HSET', KEYS[1], ARGV[1], string.match(mine, '^(%d+) ') .. ' ' .. token)
  end
end
return 1
",
    )
});
