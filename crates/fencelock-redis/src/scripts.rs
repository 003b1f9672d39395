//! The Lua scripts: one per operation, each atomic on the server.
//!
//! Layout of one lock (all keys share the hash tag `{k}`, so one cluster slot;
//! `P` is the prefix, `k` the key with `%` written `%25` and `}` written `%7D`,
//! so that no key can end the hash tag early):
//!
//! | key | type | content |
//! |---|---|---|
//! | `P{k}` | string | an exclusive hold: `"<owner>\t<holds>\t<token>\t<grants>\t<seen>"`, expiring with the key (`PX`) |
//! | `P{k}` | hash | shared or semaphore holds: `\tm` → mode; `<owner>` → `"<holds> <token> <grants> <seen>"` |
//! | `P{k}:exp` | sorted set | shared and semaphore holders: `<owner>` → expiry (server ms), so they expire one by one |
//! | `P{k}:fence` | string | the last token; never expires |
//! | `P{k}:q` | sorted set | exclusive waiters in the queue: `<owner>` → arrival (server µs) |
//! | `P{k}:qe` | sorted set | the same waiters → when their place lapses (server ms) |
//! | `P{k}:qd` | hash | the same waiters, those that can take a grant where they stand → `"<wait op> <attempt op> <ttl_ms> <channel>"` |
//! | `P{k}:ch` | channel | `free` / `permit` when waiters may proceed |
//! | `Pgrant:<client>` | channel | `g\t<owner>\t<wait op>\t<token>\t<attempt op>`: a grant handed to a waiter of that client where it stood |
//! | `P{k}:op:<op>` | string | the outcome of operation `<op>`, kept briefly (see below) |
//!
//! The type of `P{k}` tells the mode at a glance (`TYPE`: none, string, hash),
//! which keeps the exclusive path — the common one — to a handful of commands.
//! Owners cannot contain control characters, so tabs never clash.
//!
//! # Every script may run twice
//!
//! A client library may send a script again after its reply was lost (redis-rs's
//! cluster client does, on a new connection), and fencelock retries a release
//! itself. So every call carries an operation id `<op>`, unique per call, and
//! every script gives the same answer and the same effect when it runs again:
//!
//! - an owner's value lists its *grants*, one per hold it counts (`<holds>` is
//!   their number): each is the ops that got that hold as their grant — the
//!   acquire or handoff that created it or, for a reentrant acquire, added it,
//!   and any later repeat of a non-reentrant request that found it. A second
//!   run of one of them returns the hold unchanged. A lease knows its grant's
//!   op (the grant's handle), and its renewals and its release act on that
//!   grant only: on Redlock an instance that missed one of two nested
//!   acquires holds one grant, and the release of the other must not take it;
//! - `<seen>` is the fence when the owner last acted on the hold on this
//!   instance (a grant, or Redlock's write-back of its token); on Redlock a
//!   hold that the fence passed since — another owner's grant was written
//!   back here, so this hold is one a release missed — answers its owner's
//!   next acquire with a new token, not its old one;
//! - every release stores its answer under `P{k}:op:<op>` (`r …`); a second
//!   run returns it;
//! - an op given up by its caller (a cancelled acquire, a Redlock round or a
//!   handoff that fell short, a grant the replicas did not acknowledge) is
//!   undone by `UNDO`: it drops the op from its grant and takes the hold back
//!   only when no other op claims that grant — so the undo of a handoff never
//!   takes a hold the waiter's own request already counted as its grant, nor
//!   the other way round — and marks the op `x`, so that the acquire, should
//!   it arrive after its undo, grants nothing, and a release, hands nothing
//!   over.
//!
//! The marks live for six response timeouts plus 10 s (40 s by default),
//! longer than one call can go on sending: fencelock sends a release, an undo
//! or a forced release again for up to one response timeout after the first
//! send, and redis-rs's cluster client sends each of those up to four times,
//! each waiting up to one timeout for its reply, with up to three retry waits
//! of 1.28 s between (`node::mark_lifetime`).
//!
//! # The queue
//!
//! (Model-checked, with the handoff, `UNDO` and the grants where a waiter
//! stands, in `crates/fencelock-models/src/redis_queue.rs`: change both
//! together; bounds in `docs/SAFETY.md`.)
//!
//! The queue makes exclusive waiting fair across processes: while it is not
//! empty, a free lock goes only to its first live waiter (handed to it where
//! it stands, below; else a release PUBLISHes, every waiter asks, the first
//! wins). A release that hands the lock to the
//! next waiter of its own process (`next_owner`) does not free it; the core
//! bounds such handoffs to 16 in a row, then releases plainly. A waiter keeps its place by asking
//! again before its place lapses; one that died or gave up without leaving
//! blocks the queue until then. Reentrant acquires skip it; shared and
//! semaphore requests do not stand in it but are refused while anyone does, so
//! a stream of readers cannot starve a waiting writer.
//!
//! # Grants where a waiter stands
//!
//! A waiter that subscribed to its client's grant channel asks with a *wait
//! op* (one per wait) and that channel; its place then keeps its request
//! (`P{k}:qd`: wait op, the attempt op that last asked, TTL, channel). When
//! the lock is let go — a release, an undo, a leaving waiter's handed hold —
//! and the first live waiter has such a request, the same script makes it the
//! holder (new token, the wait op as the hold's grant, expiry now + its TTL)
//! and publishes the grant on its channel (`hand_on`): the waiter starts on
//! receipt, with no round trip of its own, and counts its lease from the send
//! time of the attempt op the message names (that attempt ran before the
//! grant). A lost or late message costs at most the waiter's next asking
//! (within a second, or a quarter of the TTL): its acquire finds the hold by
//! its wait op and takes it up, raising the expiry to at least now + TTL. A
//! waiter that gives up (`LEAVE_QUEUE`) marks its wait op undone and takes
//! back a hold handed to it, passing the lock on. A hold handed to a waiter
//! that died, or gave up without reaching Redis (cut off, its runtime shut
//! down), lapses with its TTL, as a holder's that died: then the next
//! waiter's asking finds the lock free. (Without grants where a waiter
//! stands, such a waiter held the queue up only until its place lapsed, 3 s.)
//!
//! # Tokens and expiry
//!
//! Tokens: `max(last + 1, server time in µs, proposal)`. The time floor keeps
//! tokens rising even if the fence key is lost (Redis restarted empty, a failover
//! to a replica that missed the last writes), provided the server clock does not
//! step back across that event and a key sees fewer than one grant per
//! microsecond. The proposal (0 for a single Redis) lets Redlock's instances
//! agree on one token in the same round trip; it never comes from a client's
//! clock (see the `redlock` module).
//!
//! A renewal only ever extends a hold's expiry: two holds of one owner with
//! different TTLs share one expiry, and renewing the shorter must not cut the
//! longer.

use std::sync::LazyLock;

use redis::{Cmd, Script, ToRedisArgs};

/// A Lua script of fencelock: its code (to load it where it is missing) and
/// its SHA1 (to call it with `EVALSHA`).
pub(crate) struct Lua {
    script: Script,
    code: &'static str,
}

impl Lua {
    fn new(code: &'static str) -> Lua {
        Lua {
            script: Script::new(code),
            code,
        }
    }

    /// A call with its first key (which routes it on a cluster).
    pub(crate) fn key(&self, key: impl ToRedisArgs) -> Call<'_> {
        Call {
            lua: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
        .key(key)
    }

    /// A call without keys yet.
    pub(crate) fn call(&self) -> Call<'_> {
        Call {
            lua: self,
            keys: Vec::new(),
            args: Vec::new(),
        }
    }

    /// `SCRIPT LOAD` of this script.
    pub(crate) fn load_cmd(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(self.code);
        cmd
    }
}

/// Every script, for loading them at connect.
pub(crate) static ALL: [&LazyLock<Lua>; 9] = [
    &ACQUIRE,
    &RENEW,
    &RELEASE,
    &UNDO,
    &LEAVE_QUEUE,
    &INSPECT,
    &FORCE_RELEASE,
    &FENCED_SET,
    &RAISE_FENCE,
];

/// One call of a script: its keys and arguments.
pub(crate) struct Call<'a> {
    lua: &'a Lua,
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call<'_> {
    /// Adds a key.
    pub(crate) fn key(mut self, key: impl ToRedisArgs) -> Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    /// Adds an argument.
    pub(crate) fn arg(mut self, arg: impl ToRedisArgs) -> Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// The script.
    pub(crate) fn lua(&self) -> &Lua {
        self.lua
    }

    /// The first key, if any (the one that routes the call on a cluster).
    pub(crate) fn first_key(&self) -> Option<&[u8]> {
        self.keys.first().map(Vec::as_slice)
    }

    /// `EVALSHA` of this call.
    pub(crate) fn evalsha(&self) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.lua.script.get_hash())
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        cmd
    }
}

/// Shared prologue: server time, token minting, purge and upkeep of shared
/// holders (who expire one by one in the sorted set).
///
/// `mint` is modelled, with Redlock's proposal and write-back, in
/// `crates/fencelock-models/src/redlock_token.rs`: change both together.
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
local now_us = string.format('%.0f', tonumber(t[1]) * 1000000 + tonumber(t[2]))
-- holder, holds, token, grants, seen of an exclusive hold (`seen`: the
-- fence when its owner last acted on it here; the token in older values)
local function exclusive(v)
  local holder, holds, token, grants, seen = string.match(v, '^([^\t]*)\t(%d+)\t(%d+)\t?([^\t]*)\t?(%d*)$')
  if seen == '' then seen = token end
  return holder, holds, token, grants, seen
end
local function xvalue(owner, holds, token, grants, seen)
  return owner .. '\t' .. holds .. '\t' .. token .. '\t' .. grants .. '\t' .. seen
end
-- holds, token, grants, seen of a shared or semaphore hold
local function shared(v)
  local holds, token, grants, seen = string.match(v, '^(%d+) (%d+) ?(%S*) ?(%d*)$')
  if seen == '' then seen = token end
  return holds, token, grants, seen
end
local function svalue(holds, token, grants, seen)
  return holds .. ' ' .. token .. ' ' .. grants .. ' ' .. seen
end
-- Grants: one per hold, separated by ';', each the ops that got that hold
-- as their grant, separated by ','. A hold is known by any of its ops.
local function split(grants)
  local out = {}
  for g in string.gmatch(grants, '[^;]+') do out[#out + 1] = g end
  return out
end
local function has(grant, op)
  return string.find(',' .. grant .. ',', ',' .. op .. ',', 1, true) ~= nil
end
-- The index of the grant op belongs to, or nil.
local function find(gs, op)
  for i = 1, #gs do
    if has(gs[i], op) then return i end
  end
  return nil
end
-- The index of the grant a lease (its grant's op) holds; an empty op, from a
-- lease without one, holds the newest.
local function held_by(gs, op)
  if op == '' then
    if #gs > 0 then return #gs end
    return nil
  end
  return find(gs, op)
end
-- gs without op: its grant goes when no other op claims it. Returns the
-- grants and whether a hold went.
local function without(gs, op)
  local i = find(gs, op)
  if not i then return gs, false end
  local left = {}
  for o in string.gmatch(gs[i], '[^,]+') do
    if o ~= op then left[#left + 1] = o end
  end
  if #left > 0 then
    gs[i] = table.concat(left, ',')
    return gs, false
  end
  table.remove(gs, i)
  return gs, true
end
-- A waiter's request, kept beside its place (`Q .. 'd'`) when it can take a
-- grant where it stands: `<wait op> <attempt op> <ttl_ms> <channel>`.
local function unqueue(Q, QE, who)
  if redis.call('ZREM', Q, who) == 1 then
    redis.call('ZREM', QE, who)
    redis.call('HDEL', Q .. 'd', who)
  end
end
local function drop_lapsed(Q, QE)
  local lapsed = redis.call('ZRANGEBYSCORE', QE, '-inf', now)
  for i = 1, #lapsed do
    redis.call('ZREM', Q, lapsed[i])
    redis.call('HDEL', Q .. 'd', lapsed[i])
  end
  if #lapsed > 0 then redis.call('ZREMRANGEBYSCORE', QE, '-inf', now) end
end
-- The lock H is free: the first live waiter in the queue gets it now, if it
-- can take a grant where it stands (its request is kept), and is told on its
-- own channel. Returns whether it did; if not, the caller frees the lock and
-- wakes the waiters. A waiter that gave up (its wait op marked `x`) is
-- passed over.
local function hand_on(H, F, Q, QE)
  if redis.call('EXISTS', Q) == 0 then return false end
  drop_lapsed(Q, QE)
  while true do
    local first = redis.call('ZRANGE', Q, 0, 0)[1]
    if not first then return false end
    local d = redis.call('HGET', Q .. 'd', first)
    if not d then return false end
    local w, a, ttl, ch = string.match(d, '^(%S+) (%S+) (%d+) (.+)$')
    -- Unreadable: leave it to the waiter's own asking.
    if not w then return false end
    if redis.call('GET', H .. ':op:' .. w) ~= 'x' then
      local token = mint(F, 0)
      redis.call('SET', H, xvalue(first, 1, token, w, token), 'PX', ttl)
      unqueue(Q, QE, first)
      redis.call('PUBLISH', ch, 'g\t' .. first .. '\t' .. w .. '\t' .. token .. '\t' .. a)
      return true
    end
    unqueue(Q, QE, first)
  end
end
"
    };
}

/// KEYS: H, Z, F, Q, QE, L (the op's mark). ARGV: owner, mode, ttl_ms, reentrant
/// (1/0), permits, proposal (a floor for a new token; 0 for none), queue_ms (an
/// exclusive request that is refused stands in the queue for that long; 0: it does
/// not), op, mark_ms, behind (1/0: an existing hold of the owner whose token
/// is below the fence gets a new token — Redlock, where the fence can pass a
/// hold that a release missed, see the `redlock` module), wait_op and
/// grant_channel (a waiter that can take a grant where it stands: the op its
/// wait is known by and the channel it hears grants on; '' for none — see
/// "Grants where a waiter stands" above).
///
/// Returns `{1, token, holds, mine, now_us, by_wait}` granted (`mine`: 1 when this op
/// created the hold or ran before, 0 when it found or added to an existing
/// hold of the owner; `by_wait`: 1 when the hold is the one a release handed
/// to `wait_op` where it stood, its expiry now at least now + ttl), `{0, ms_until_first_expiry, now_us}` busy (also for an op already
/// undone), `{-1, held_mode}` when the owner holds the key in another mode,
/// `{-2, held_mode}` when a semaphore is held with another permit count.
pub(crate) static ACQUIRE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        prologue!(),
        r"
local H, Z, F, Q, QE, L = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local owner, mode, ttl, reentrant, permits = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local queue_ms, op, mark_ms, behind = tonumber(ARGV[7]), ARGV[8], ARGV[9], ARGV[10]
local wait_op, grant_ch = ARGV[11] or '', ARGV[12] or ''
if redis.call('GET', L) == 'x' then return {0, 0, now_us} end
-- A late attempt of a waiter that gave up does not stand in the queue again.
if wait_op ~= '' and redis.call('GET', H .. ':op:' .. wait_op) == 'x' then queue_ms = 0 end
local queued = redis.call('EXISTS', Q) == 1
-- Refused: stand in the queue (or keep the place) if asked to, and say how long to wait.
local function refuse(wait_ms)
  if mode == 'exclusive' and queue_ms > 0 then
    redis.call('ZADD', Q, 'NX', now_us, owner)
    redis.call('ZADD', QE, now + queue_ms, owner)
    if wait_op ~= '' and grant_ch ~= '' then
      redis.call('HSET', Q .. 'd', owner, wait_op .. ' ' .. op .. ' ' .. ttl .. ' ' .. grant_ch)
    else
      redis.call('HDEL', Q .. 'd', owner)
    end
    local last = redis.call('ZRANGE', QE, -1, -1, 'WITHSCORES')
    redis.call('PEXPIRE', Q, tonumber(last[2]) - now)
    redis.call('PEXPIRE', QE, tonumber(last[2]) - now)
    redis.call('PEXPIRE', Q .. 'd', tonumber(last[2]) - now)
  end
  return {0, wait_ms, now_us}
end
-- A new grant waits for the live waiters in the queue: an exclusive one unless it
-- is first, a shared or semaphore one while anyone stands there.
local function ahead()
  if not queued then return nil end
  drop_lapsed(Q, QE)
  local first = redis.call('ZRANGE', Q, 0, 0)[1]
  if first == nil or (first == owner and mode == 'exclusive') then return nil end
  return tonumber(redis.call('ZSCORE', QE, first)) - now
end
local function granted(token)
  if queued then unqueue(Q, QE, owner) end
  return {1, token, 1, 1, now_us}
end
-- The owner's existing hold: a second run of this op (unchanged), a
-- reentrant acquire (one grant more, this op's) or a repeat (unchanged, but
-- this op now claims the first grant too, so that undoing the op that made
-- it leaves it to this one). Only ever extends the expiry. With `behind`, a
-- hold that the fence passed since its owner last acted on it here (another
-- owner's later grant was written back here: the hold is one a release
-- missed) answers a new token.
local function existing(token, grants, seen, write)
  local gs = split(grants)
  if find(gs, op) then return {1, token, #gs, 1, now_us} end
  if behind == '1' and tonumber(redis.call('GET', F) or '0') > tonumber(seen) then
    token = mint(F, ARGV[6])
    seen = token
  end
  if reentrant == '1' or #gs == 0 then
    gs[#gs + 1] = op
  else
    gs[1] = gs[1] .. ',' .. op
  end
  write(#gs, token, table.concat(gs, ';'), seen)
  return {1, token, #gs, 0, now_us}
end
local function take(token)
  if mode == 'exclusive' then
    redis.call('SET', H, xvalue(owner, 1, token, op, token), 'PX', ttl)
  else
    redis.call('DEL', Z)
    redis.call('HSET', H, '\tm', mode, owner, svalue(1, token, op, token))
    redis.call('ZADD', Z, now + ttl, owner)
    keep_alive(H, Z)
  end
  return granted(token)
end
local kind = redis.call('TYPE', H)['ok']
if kind == 'none' then
  local wait = ahead()
  if wait then return refuse(wait) end
  return take(mint(F, ARGV[6]))
end
if kind == 'string' then
  local holder, holds, token, hop, seen = exclusive(redis.call('GET', H))
  if holder ~= owner then return refuse(redis.call('PTTL', H)) end
  if mode ~= 'exclusive' then return {-1, 'exclusive'} end
  if redis.call('PTTL', H) < ttl then redis.call('PEXPIRE', H, ttl) end
  -- Handed to this waiter where it stood (its message may be lost or late):
  -- that grant is this wait's, with its expiry now at least now + ttl.
  if wait_op ~= '' and find(split(hop), wait_op) then
    return {1, token, holds, 1, now_us, 1}
  end
  return existing(token, hop, seen, function(n, tok, grants, sn)
    redis.call('SET', H, xvalue(owner, n, tok, grants, sn), 'KEEPTTL')
  end)
end
-- Shared or semaphore holders, each with its own expiry.
local held = redis.call('HGET', H, '\tm') or ''
local n = purge(H, Z)
if n == 0 then
  local wait = ahead()
  if wait then return refuse(wait) end
  redis.call('DEL', H, Z)
  return take(mint(F, ARGV[6]))
end
local mine = redis.call('HGET', H, owner)
if mine then
  if held ~= mode then return {-1, held} end
  redis.call('ZADD', Z, math.max(tonumber(redis.call('ZSCORE', Z, owner) or '0'), now + ttl), owner)
  keep_alive(H, Z)
  local _, token, hop, seen = shared(mine)
  return existing(token, hop, seen, function(n, tok, grants, sn)
    redis.call('HSET', H, owner, svalue(n, tok, grants, sn))
  end)
end
-- A key has one permit count while held.
if string.sub(mode, 1, 10) == 'semaphore:' and string.sub(held, 1, 10) == 'semaphore:' and held ~= mode then
  return {-2, held}
end
local ok = (mode == 'shared' and held == 'shared')
  or (string.sub(mode, 1, 10) == 'semaphore:' and held == mode and n < permits)
if not ok then
  local first = redis.call('ZRANGE', Z, 0, 0, 'WITHSCORES')
  return refuse(tonumber(first[2]) - now)
end
local wait = ahead()
if wait then return refuse(wait) end
local token = mint(F, ARGV[6])
redis.call('HSET', H, owner, svalue(1, token, op, token))
redis.call('ZADD', Z, now + ttl, owner)
keep_alive(H, Z)
return {1, token, 1, 1, now_us}
"
    ))
});

/// KEYS: H1, Z1, H2, Z2, …  ARGV: owner1, ttl1_ms, grant1, owner2, … (`grant`:
/// the op of the lease's grant; '' for any hold of the owner).
/// Returns one 1 (renewed) or 0 (not held) per lease: held means the owner
/// still has the lease's own grant. Never re-creates a hold, and never
/// shortens one: the expiry becomes at least now + ttl.
pub(crate) static RENEW: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        prologue!(),
        r"
local out = {}
for i = 1, #KEYS / 2 do
  local H, Z = KEYS[2 * i - 1], KEYS[2 * i]
  local owner, ttl, grant = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1]), ARGV[3 * i]
  local kind = redis.call('TYPE', H)['ok']
  local ok = 0
  if kind == 'string' then
    local holder, _, _, grants = exclusive(redis.call('GET', H))
    if holder == owner and held_by(split(grants or ''), grant) then
      if redis.call('PTTL', H) < ttl then redis.call('PEXPIRE', H, ttl) end
      ok = 1
    end
  elseif kind == 'hash' then
    local until_ms = tonumber(redis.call('ZSCORE', Z, owner) or '0')
    local mine = redis.call('HGET', H, owner)
    if mine and until_ms > now and held_by(split(select(3, shared(mine)) or ''), grant) then
      redis.call('ZADD', Z, math.max(until_ms, now + ttl), owner)
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

/// KEYS: H, Z, L (the op's mark), F, Q, QE. ARGV: owner, channel, mark_ms,
/// next_owner ('' for none), next_ttl_ms, proposal (floor of the next token),
/// op, grant (the op of the lease's grant; '' for the owner's newest hold).
///
/// Returns `{holds_left, handed_token, now_us}`: `holds_left` is -1 when the
/// owner does not hold the lease's grant, else the holds left (0: let go).
/// Only that grant goes: never another hold of the same owner. When an exclusive lock is let go
/// and `next_owner` is given, the lock passes to `next_owner` in the same step
/// (new token, created by this op, no window for anybody else) and
/// `handed_token` is its token; otherwise `handed_token` is 0 and the lock
/// goes to the first waiter in the queue that can take a grant where it
/// stands (`hand_on`), else waiters are told on the channel.
///
/// The answer is kept under the op's mark: a second run returns it and changes
/// nothing, so a release retried after a lost reply cannot take a second hold
/// away, and one that never ran before reports -1 if the owner holds nothing.
/// An op marked undone (`x`) releases without handing over.
pub(crate) static RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        prologue!(),
        r"
local H, Z, L, F = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, channel, mark_ms, next_owner, op, grant = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[7], ARGV[8]
local mark = redis.call('GET', L)
if mark and mark ~= 'x' then
  local left, handed = string.match(mark, '^r (%-?%d+) (%d+)$')
  return {tonumber(left), handed, now_us}
end
if mark == 'x' then next_owner = '' end
local function answer(left, handed)
  redis.call('SET', L, 'r ' .. left .. ' ' .. handed, 'PX', mark_ms)
  return {left, handed, now_us}
end
local kind = redis.call('TYPE', H)['ok']
if kind == 'string' then
  local holder, _, token, hop, seen = exclusive(redis.call('GET', H))
  local gs = split(hop or '')
  local i = held_by(gs, grant)
  if holder == owner and i then
    table.remove(gs, i)
    local holds = #gs
    if holds > 0 then
      redis.call('SET', H, xvalue(owner, holds, token, table.concat(gs, ';'), seen), 'KEEPTTL')
      return answer(holds, 0)
    end
    if next_owner ~= '' then
      local next_token = mint(F, ARGV[6])
      redis.call('SET', H, xvalue(next_owner, 1, next_token, op, next_token), 'PX', ARGV[5])
      unqueue(KEYS[5], KEYS[6], next_owner)
      return answer(0, next_token)
    end
    if not hand_on(H, F, KEYS[5], KEYS[6]) then
      redis.call('DEL', H)
      redis.call('PUBLISH', channel, 'free')
    end
    return answer(0, 0)
  end
elseif kind == 'hash' then
  local mine = redis.call('HGET', H, owner)
  local _, token, hop, seen = shared(mine or '')
  local gs = split(hop or '')
  local i = held_by(gs, grant)
  if mine and i and tonumber(redis.call('ZSCORE', Z, owner) or '0') > now then
    table.remove(gs, i)
    local holds = #gs
    if holds > 0 then
      redis.call('HSET', H, owner, svalue(holds, token, table.concat(gs, ';'), seen))
      return answer(holds, 0)
    end
    redis.call('HDEL', H, owner)
    redis.call('ZREM', Z, owner)
    if redis.call('ZCARD', Z) == 0 then
      redis.call('DEL', H, Z)
      if not hand_on(H, F, KEYS[5], KEYS[6]) then redis.call('PUBLISH', channel, 'free') end
    elseif string.sub(redis.call('HGET', H, '\tm') or '', 1, 10) == 'semaphore:' then
      redis.call('PUBLISH', channel, 'permit')
    end
    return answer(0, 0)
  end
end
return {-1, 0, now_us}
"
    ))
});

/// KEYS: H, Z, L (the op's mark), F, Q, QE. ARGV: owner, channel, mark_ms, op.
///
/// Undoes acquire op `op` of `owner`, or the handoff of release op `op` to
/// `owner`: takes back the one hold (grant) that op created or added
/// (releasing the lock if it was the last) once no other op claims it, nothing else, and
/// marks the op undone so that it grants nothing should it run later. Returns
/// 1 if a hold was taken back.
pub(crate) static UNDO: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        prologue!(),
        r"
local H, Z, L, F, Q, QE = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local owner, channel, mark_ms, op = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local mark = redis.call('GET', L)
if mark == 'x' then return 0 end
redis.call('SET', L, 'x', 'PX', mark_ms)
local kind = redis.call('TYPE', H)['ok']
if kind == 'string' then
  local holder, _, token, grants, seen = exclusive(redis.call('GET', H))
  if holder ~= owner then return 0 end
  local gs, went = without(split(grants or ''), op)
  if #gs > 0 then
    redis.call('SET', H, xvalue(owner, #gs, token, table.concat(gs, ';'), seen), 'KEEPTTL')
  elseif went and not hand_on(H, F, Q, QE) then
    redis.call('DEL', H)
    redis.call('PUBLISH', channel, 'free')
  end
  if went then return 1 end
  return 0
elseif kind == 'hash' then
  local mine = redis.call('HGET', H, owner)
  if not mine then return 0 end
  local _, token, grants, seen = shared(mine)
  local gs, went = without(split(grants or ''), op)
  if #gs > 0 then
    redis.call('HSET', H, owner, svalue(#gs, token, table.concat(gs, ';'), seen))
  end
  if not went then return 0 end
  if #gs > 0 then return 1 end
  redis.call('HDEL', H, owner)
  redis.call('ZREM', Z, owner)
  if redis.call('ZCARD', Z) == 0 then
    redis.call('DEL', H, Z)
    if not hand_on(H, F, Q, QE) then redis.call('PUBLISH', channel, 'free') end
  else
    redis.call('PUBLISH', channel, 'permit')
  end
  return 1
end
return 0
"
    ))
});

/// KEYS: Q, QE, H, F. ARGV: owner, channel, wait_op ('' for none), mark_ms.
/// A waiter that gives up: marks its wait op undone (a late attempt of it
/// does not stand in the queue again, and no release hands it the lock), takes
/// back a hold handed to it where it stood that it did not take up, passing
/// the lock on (to the next waiter in the queue, else waking the waiters),
/// and takes `owner` out of the queue; if it was first, wakes the waiters it
/// held up (the next writer if the lock is free, readers refused while it
/// stood there). Returns 1 if a handed hold was taken back.
pub(crate) static LEAVE_QUEUE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        prologue!(),
        r"
local Q, QE, H, F = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local owner, channel, wait_op, mark_ms = ARGV[1], ARGV[2], ARGV[3] or '', ARGV[4]
local took = 0
if wait_op ~= '' then
  redis.call('SET', H .. ':op:' .. wait_op, 'x', 'PX', mark_ms)
  if redis.call('TYPE', H)['ok'] == 'string' then
    local holder, _, token, grants, seen = exclusive(redis.call('GET', H))
    if holder == owner then
      local gs, went = without(split(grants or ''), wait_op)
      if #gs > 0 then
        redis.call('SET', H, xvalue(owner, #gs, token, table.concat(gs, ';'), seen), 'KEEPTTL')
      elseif went and not hand_on(H, F, Q, QE) then
        redis.call('DEL', H)
        redis.call('PUBLISH', channel, 'free')
      end
      if went then took = 1 end
    end
  end
end
local first = redis.call('ZRANK', Q, owner) == 0
if redis.call('ZREM', Q, owner) == 0 then return took end
redis.call('ZREM', QE, owner)
redis.call('HDEL', Q .. 'd', owner)
if first then
  if redis.call('TYPE', H)['ok'] == 'none' then hand_on(H, F, Q, QE) end
  redis.call('PUBLISH', channel, 'free')
end
return took
"
    ))
});

/// KEYS: H, Z, F. Returns `{now_ms, fence, kind, holders, expiries, pttl}` where
/// `holders` is `{owner, "<holds> <token>", …}` plus `\tm` → mode for a hash,
/// or the exclusive value for a string.
pub(crate) static INSPECT: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
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

/// KEYS: H, Z, the op's mark. ARGV: channel, mark_ms. Deletes every hold (the
/// fence stays) and wakes waiters; a second run of the op does nothing.
pub(crate) static FORCE_RELEASE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
if redis.call('SET', KEYS[3], 'r', 'NX', 'PX', ARGV[2]) == false then return 0 end
local n = redis.call('DEL', KEYS[1], KEYS[2])
redis.call('PUBLISH', ARGV[1], 'free')
return n
",
    )
});

/// KEYS: resource hash, the op's mark (or none). ARGV: token, value, mark_ms.
/// Writes `value` and records `token` unless the resource has seen a larger
/// token. Returns 1 written, 0 rejected; a second run of the op returns the
/// first's answer and writes nothing.
pub(crate) static FENCED_SET: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(
        r"
if KEYS[2] then
  local done = redis.call('GET', KEYS[2])
  if done then return tonumber(done) end
end
local seen = redis.call('HGET', KEYS[1], 'token')
local ok = 1
if seen and tonumber(seen) > tonumber(ARGV[1]) then
  ok = 0
else
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'value', ARGV[2])
end
if KEYS[2] then redis.call('SET', KEYS[2], ok, 'PX', ARGV[3]) end
return ok
",
    )
});

/// KEYS: H, F. ARGV: owner, token, grant (the op of the grant the token is
/// for). Raises the fence to at least `token` and, if the owner's hold still
/// lists that grant, records `token` as the hold's and raises its `seen` to
/// `token` — never to the fence, which another owner's grant may have raised
/// past it (a write-back can arrive late) — Redlock's quorum max-register
/// write.
pub(crate) static RAISE_FENCE: LazyLock<Lua> = LazyLock::new(|| {
    Lua::new(concat!(
        prologue!(),
        r"
local token, grant = ARGV[2], ARGV[3]
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(token) then
  redis.call('SET', KEYS[2], token)
end
local function raised(seen)
  return string.format('%.0f', math.max(tonumber(seen), tonumber(token)))
end
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'string' then
  local holder, holds, _, grants, seen = exclusive(redis.call('GET', KEYS[1]))
  if holder == ARGV[1] and find(split(grants), grant) then
    redis.call('SET', KEYS[1], xvalue(holder, holds, token, grants, raised(seen)), 'KEEPTTL')
  end
elseif kind == 'hash' then
  local mine = redis.call('HGET', KEYS[1], ARGV[1])
  if mine then
    local holds, _, grants, seen = shared(mine)
    if grants and find(split(grants), grant) then
      redis.call('HSET', KEYS[1], ARGV[1], svalue(holds, token, grants, raised(seen)))
    end
  end
end
return 1
"
    ))
});
