//! The SQL of the SQLite backend. Every function runs on a blocking thread and
//! every change is one `BEGIN IMMEDIATE` transaction.

use std::path::Path;
use std::time::Duration;

use fencelock_core::backend::{
    Admission, LeaseRef, Released, Renewal, Request, admit, unix_millis,
};
use fencelock_core::{Error, FencingToken, HolderInfo, Key, LockInfo, Mode, Result};
use rusqlite::{
    Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior, params,
};

use crate::NAME;
use crate::options::{SqliteOptions, Synchronous};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS fencelock_locks (
    key   TEXT PRIMARY KEY NOT NULL,
    fence INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS fencelock_meta (
    k TEXT PRIMARY KEY NOT NULL,
    v TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS fencelock_holders (
    key         TEXT NOT NULL,
    owner       TEXT NOT NULL,
    mode        TEXT NOT NULL,
    holds       INTEGER NOT NULL,
    token       INTEGER NOT NULL,
    expires_at  INTEGER NOT NULL,
    acquired_at INTEGER NOT NULL,
    PRIMARY KEY (key, owner)
) WITHOUT ROWID;
";

fn db_err(e: rusqlite::Error) -> Error {
    let err = match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => {
            Error::backend(
                NAME,
                format!(
                    "{e}: another process kept the lock file busy longer than busy_timeout; raise ?busy_timeout="
                ),
            )
        }
        _ => Error::backend(NAME, &e),
    };
    err.with_source(e)
}

/// The clock expiry times are kept on: the machine's boot-time clock (Linux
/// `CLOCK_BOOTTIME`, which steps neither with the wall clock nor stops in a
/// suspend), named by the boot's id, so that rows from before a reboot are
/// recognised; elsewhere the wall clock.
struct ExpiryClock;

impl ExpiryClock {
    /// Now, in ms.
    /// Now, in ms of the machine's (not a time namespace's) boot-time clock.
    #[cfg(target_os = "linux")]
    fn now_ms() -> i64 {
        match nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME) {
            Ok(t) => {
                t.tv_sec().saturating_mul(1000) + t.tv_nsec() / 1_000_000
                    - Self::namespace_offset_ms()
            }
            Err(_) => unix_millis(std::time::SystemTime::now()),
        }
    }

    /// How far a time namespace (`unshare --time --boottime N`) shifts this
    /// process's boot-time clock from the machine's, in ms.
    #[cfg(target_os = "linux")]
    fn namespace_offset_ms() -> i64 {
        static OFFSET: std::sync::OnceLock<i64> = std::sync::OnceLock::new();
        *OFFSET.get_or_init(|| {
            let text = std::fs::read_to_string("/proc/self/timens_offsets").unwrap_or_default();
            text.lines()
                .find_map(|l| {
                    let mut f = l.split_whitespace();
                    if f.next()? != "boottime" {
                        return None;
                    }
                    let secs: i64 = f.next()?.parse().ok()?;
                    let nanos: i64 = f.next()?.parse().ok()?;
                    Some(secs.saturating_mul(1000) + nanos / 1_000_000)
                })
                .unwrap_or(0)
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn now_ms() -> i64 {
        unix_millis(std::time::SystemTime::now())
    }

    /// The name of this clock's epoch: `boot:<boot id>` (Linux), or `wall`.
    ///
    /// # Errors
    ///
    /// On Linux, if the boot's id cannot be read (no `/proc`): expiry times
    /// of the boot-time clock could not be told from another boot's.
    fn epoch() -> std::result::Result<&'static str, String> {
        static EPOCH: std::sync::OnceLock<std::result::Result<String, String>> =
            std::sync::OnceLock::new();
        EPOCH
            .get_or_init(|| {
                #[cfg(target_os = "linux")]
                return std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                    .map(|id| format!("boot:{}", id.trim()))
                    .map_err(|e| {
                        format!(
                            "cannot read /proc/sys/kernel/random/boot_id ({e}): the SQLite backend keeps expiry on the boot-time clock and needs /proc to know the boot"
                        )
                    });
                #[cfg(not(target_os = "linux"))]
                Ok("wall".to_string())
            })
            .as_deref()
            .map_err(Clone::clone)
    }
}

fn now_ms() -> i64 {
    ExpiryClock::now_ms()
}

/// The wall clock in µs: the floor of every new token, so that a recreated
/// or restored file cannot hand out a token again (while the wall clock does
/// not step back across it).
fn token_floor() -> i64 {
    fencelock_core::clock::wall_now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX))
}

/// Brings the file's expiry times onto this process's clock, inside a write
/// transaction: rows of another boot are of processes that are gone (deleted);
/// rows of a file without an epoch, or on the wall clock, are moved onto the
/// boot-time clock.
fn align_clock(tx: &Transaction<'_>) -> Result<()> {
    let epoch = ExpiryClock::epoch().map_err(|e| Error::backend(NAME, e))?;
    let theirs: Option<String> = tx
        .prepare_cached("SELECT v FROM fencelock_meta WHERE k = 'clock'")
        .and_then(|mut s| s.query_row([], |r| r.get(0)).optional())
        .map_err(db_err)?;
    if theirs.as_deref() == Some(epoch) {
        return Ok(());
    }
    match theirs.as_deref() {
        // Unix ms (a file of an earlier version, or of a system without a
        // boot clock): shift onto this clock.
        None | Some("wall") if epoch != "wall" => {
            let shift = unix_millis(std::time::SystemTime::now()) - now_ms();
            tx.execute(
                "UPDATE fencelock_holders SET expires_at = expires_at - ?1, acquired_at = acquired_at - ?1",
                params![shift],
            )
            .map_err(db_err)?;
        }
        None => {}
        // Another boot: its holders died with it.
        Some(_) => {
            tx.execute("DELETE FROM fencelock_holders", [])
                .map_err(db_err)?;
        }
    }
    tx.execute(
        "INSERT INTO fencelock_meta (k, v) VALUES ('clock', ?1)
         ON CONFLICT (k) DO UPDATE SET v = excluded.v",
        params![epoch],
    )
    .map_err(db_err)?;
    Ok(())
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// The lock file, its WAL and its shared-memory file as a connection opened
/// them (device, inode): processes exclude each other only through the same
/// three files, so a file deleted, replaced or given a second name while in
/// use ends what this connection's holds are worth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    files: Vec<(std::path::PathBuf, u64, u64)>,
}

fn with_suffix(path: &Path, suffix: &str) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(suffix);
    p.into()
}

/// Refuses a lock file with more than one name: SQLite keeps a WAL and a
/// shared-memory file per name, so processes using different names would
/// not exclude each other.
fn one_name(path: &Path, meta: &std::fs::Metadata) -> std::result::Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    if meta.is_dir() {
        return Err(format!(
            "{} is a directory; name a file in it (sqlite://{}/locks.db)",
            path.display(),
            path.display()
        ));
    }
    match meta.nlink() {
        0 => Err(format!("the lock file {} was deleted", path.display())),
        1 => Ok(()),
        n => Err(format!(
            "the lock file {} has {n} names (hard links): processes using another name would not exclude these (each name has a WAL of its own); remove the other links",
            path.display()
        )),
    }
}

/// Refuses a lock file that is itself a mount point (`mount --bind` of the
/// file, `docker -v file:file`): the second name has the same inode and one
/// link, yet SQLite keeps a WAL and shared-memory file per name, so the
/// processes on either side would not exclude each other.
fn not_mounted_alone(path: &Path) -> std::result::Result<(), String> {
    #[cfg(target_os = "linux")]
    {
        let Ok(real) = std::fs::canonicalize(path) else {
            return Ok(());
        };
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        // Field 5 is the mount point, with spaces and the like as octal escapes.
        let target = real.to_string_lossy().replace(' ', "\\040");
        if mounts
            .lines()
            .any(|l| l.split_whitespace().nth(4) == Some(target.as_str()))
        {
            return Err(format!(
                "the lock file {} is a mount point of its own (a bind mount of the file): processes on the other side of the mount would not exclude these; mount its directory instead",
                path.display()
            ));
        }
    }
    let _ = path;
    Ok(())
}

impl Identity {
    /// The files of the lock file at `path` now.
    pub(crate) fn of(path: &Path) -> std::result::Result<Identity, String> {
        use std::os::unix::fs::MetadataExt;
        // SQLite keeps the WAL and shared-memory file beside the file a
        // symlink points to, not beside the link.
        let real = std::fs::canonicalize(path)
            .map_err(|e| format!("cannot look at {}: {e}", path.display()))?;
        let mut files = Vec::with_capacity(3);
        for suffix in ["", "-wal", "-shm"] {
            let p = if suffix.is_empty() {
                path.to_path_buf()
            } else {
                with_suffix(&real, suffix)
            };
            match std::fs::metadata(&p) {
                Ok(m) => {
                    if suffix.is_empty() {
                        one_name(path, &m)?;
                    }
                    files.push((p, m.dev(), m.ino()));
                }
                Err(e) if suffix.is_empty() => {
                    return Err(format!("cannot look at {}: {e}", path.display()));
                }
                Err(_) => {}
            }
        }
        Ok(Identity { files })
    }

    /// Why the files at the path are no longer these, if they are not.
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        use std::os::unix::fs::MetadataExt;
        for (i, (p, dev, ino)) in self.files.iter().enumerate() {
            let m = std::fs::metadata(p).map_err(|_| {
                format!(
                    "{} was deleted while in use: the lock file is no longer the one every process shares",
                    p.display()
                )
            })?;
            if i == 0 {
                one_name(p, &m)?;
            }
            if (m.dev(), m.ino()) != (*dev, *ino) {
                return Err(format!(
                    "{} was replaced while in use: the lock file is no longer the one every process shares",
                    p.display()
                ));
            }
        }
        Ok(())
    }
}

/// Opens the lock file at `path`, creating it and its tables if needed; with
/// the identity of its files once open.
pub(crate) fn open(path: &Path, options: &SqliteOptions) -> Result<(Connection, Identity)> {
    let addr = format!("sqlite://{}", path.display());
    // A file that cannot be opened stays so: no wait goes on through it.
    let lasting = |e: String| Error::connection(NAME, &addr, e).lasting();
    if let Ok(m) = std::fs::metadata(path) {
        one_name(path, &m).map_err(lasting)?;
        not_mounted_alone(path).map_err(lasting)?;
    }
    ExpiryClock::epoch().map_err(lasting)?;
    let conn = open_connection(path, options)?;
    let id = Identity::of(path).map_err(lasting)?;
    Ok((conn, id))
}

/// Opens the file, tried again while other processes keep it busy (up to the
/// busy timeout): SQLite answers some steps of opening — switching a new file
/// to WAL among them — with "busy" at once, without waiting.
fn open_connection(path: &Path, options: &SqliteOptions) -> Result<Connection> {
    let give_up = std::time::Instant::now() + options.busy_timeout;
    let mut pause = Duration::from_millis(2);
    loop {
        match open_once(path, options) {
            Err(OpenError::Busy(_)) if std::time::Instant::now() + pause < give_up => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(100));
            }
            Err(OpenError::Busy(e) | OpenError::Other(e)) => return Err(e),
            Ok(c) => return Ok(c),
        }
    }
}

enum OpenError {
    Busy(Error),
    Other(Error),
}

fn open_once(path: &Path, options: &SqliteOptions) -> std::result::Result<Connection, OpenError> {
    let addr = format!("sqlite://{}", path.display());
    let conn_err = |e: rusqlite::Error| {
        if is_busy(&e) {
            OpenError::Busy(Error::connection(
                NAME,
                &addr,
                format!(
                    "{e}: another process keeps the file's write lock (a transaction of a stopped process holds it until the process resumes or ends)"
                ),
            ))
        } else {
            OpenError::Other(Error::connection(NAME, &addr, e).lasting())
        }
    };
    let conn = Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(conn_err)?;
    conn.busy_timeout(options.busy_timeout).map_err(conn_err)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(conn_err)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(OpenError::Other(Error::connection(
            NAME,
            &addr,
            format!(
                "cannot switch the lock file to WAL mode (got {mode}); is it on a network filesystem?"
            ),
        )
        .lasting()));
    }
    let sync = match options.synchronous {
        Synchronous::Normal => "NORMAL",
        Synchronous::Full => "FULL",
    };
    conn.execute_batch(&format!("PRAGMA synchronous={sync};"))
        .map_err(conn_err)?;
    // A file in use has its schema and clock already: a read says so, and
    // the write lock (which another process may keep) is not needed.
    if ready(&conn) {
        return Ok(conn);
    }
    let mut conn = conn;
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(conn_err)?;
    tx.execute_batch(SCHEMA).map_err(conn_err)?;
    align_clock(&tx).map_err(OpenError::Other)?;
    tx.pragma_update(None, "user_version", SCHEMA_VERSION)
        .map_err(conn_err)?;
    tx.commit().map_err(conn_err)?;
    Ok(conn)
}

/// The version of [`SCHEMA`], kept in the file's `user_version`: raise it
/// whenever the schema changes, so that files of earlier versions are set
/// up anew.
const SCHEMA_VERSION: i64 = 1;

/// Whether the file has this version's schema and this boot's clock.
fn ready(conn: &Connection) -> bool {
    let version: rusqlite::Result<i64> = conn.query_row("PRAGMA user_version", [], |r| r.get(0));
    if version.ok() != Some(SCHEMA_VERSION) {
        return false;
    }
    let clock: rusqlite::Result<String> =
        conn.query_row("SELECT v FROM fencelock_meta WHERE k = 'clock'", [], |r| {
            r.get(0)
        });
    matches!((clock, ExpiryClock::epoch()), (Ok(theirs), Ok(ours)) if theirs == ours)
}

fn immediate(conn: &mut Connection) -> Result<Transaction<'_>> {
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(db_err)?;
    align_clock(&tx)?;
    Ok(tx)
}

/// Whether `e` is another process keeping the file's write lock past the
/// busy timeout.
fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked)
    )
}

/// How long an operation for holds of `ttl` may wait for the file's write
/// lock: at most a third of the TTL, so that a renewal blocked by another
/// process still leaves room to retry before the deadline.
fn busy_timeout_for(conn: &Connection, configured: Duration, ttl: Duration) -> Result<()> {
    conn.busy_timeout(configured.min(ttl / 3).max(Duration::from_millis(1)))
        .map_err(db_err)
}

/// A grant made in a transaction: its token, the owner's hold count, and when
/// the transaction (which set its expiry) began on this machine's monotonic
/// clock — the grant's lease counts from there, however long the write lock
/// kept it waiting.
pub(crate) type Granted = (FencingToken, u32, tokio::time::Instant);

struct Row {
    owner: String,
    mode: Mode,
    holds: u32,
    token: u64,
    expires_at: i64,
}

/// Unexpired holders of `key` at `now`.
fn holders(conn: &Connection, key: &str, now: i64) -> Result<Vec<Row>> {
    let mut stmt = conn
        .prepare_cached(
            "SELECT owner, mode, holds, token, expires_at FROM fencelock_holders
             WHERE key = ?1 AND expires_at > ?2 ORDER BY acquired_at",
        )
        .map_err(db_err)?;
    let rows = stmt
        .query_map(params![key, now], |r| {
            Ok((
                r.get::<_, String>(0)?,
                r.get::<_, String>(1)?,
                r.get::<_, i64>(2)?,
                r.get::<_, i64>(3)?,
                r.get::<_, i64>(4)?,
            ))
        })
        .map_err(db_err)?;
    let mut out = Vec::new();
    for row in rows {
        let (owner, mode, holds, token, expires_at) = row.map_err(db_err)?;
        out.push(Row {
            owner,
            mode: Mode::parse(&mode)
                .map_err(|e| Error::backend(NAME, format!("corrupt holder row: {e}")))?,
            holds: u32::try_from(holds).unwrap_or(u32::MAX),
            token: u64::try_from(token).unwrap_or(0),
            expires_at,
        });
    }
    Ok(out)
}

fn purge(tx: &Transaction<'_>, key: &str, now: i64) -> Result<()> {
    tx.prepare_cached("DELETE FROM fencelock_holders WHERE key = ?1 AND expires_at <= ?2")
        .and_then(|mut s| s.execute(params![key, now]))
        .map_err(db_err)?;
    Ok(())
}

/// Grants `req` if it is admitted. Another process keeping the file's write
/// lock past the busy timeout (at most ttl/3) is "not now" (`None`), like a
/// held lock: a waiter tries again.
pub(crate) fn try_acquire(
    conn: &mut Connection,
    req: &Request,
    busy_timeout: Duration,
) -> Result<Option<Granted>> {
    busy_timeout_for(conn, busy_timeout, req.ttl)?;
    let begun = conn.transaction_with_behavior(TransactionBehavior::Immediate);
    if matches!(&begun, Err(e) if is_busy(e)) {
        drop(begun);
        kept_busy(conn, busy_timeout.min(req.ttl / 3));
        return Ok(None);
    }
    let tx = begun.map_err(db_err)?;
    align_clock(&tx)?;
    let began = tokio::time::Instant::now();
    let now = now_ms();
    purge(&tx, req.key.as_str(), now)?;
    let granted = grant(&tx, req, now)?;
    match tx.commit() {
        Ok(()) => Ok(granted.map(|(t, h)| (t, h, began))),
        Err(e) if is_busy(&e) => {
            kept_busy(conn, busy_timeout.min(req.ttl / 3));
            Ok(None)
        }
        Err(e) => Err(db_err(e)),
    }
}

/// Says that another process kept the file's write lock for `waited` (a
/// live one holds it for milliseconds): a wait that then ends says
/// "not acquired", and this line tells the real cause.
fn kept_busy(conn: &Connection, waited: Duration) {
    if waited >= Duration::from_secs(1) {
        tracing::warn!(
            file = conn.path().unwrap_or("?"),
            "another process kept the lock file busy for {} (a transaction of a process that is stopped or stuck holds it until the process resumes or ends); waiting on",
            humantime::format_duration(waited)
        );
    }
}

/// Grants `req` inside `tx` if it is admitted (expired holders already purged);
/// returns the token and the owner's hold count.
fn grant(tx: &Transaction<'_>, req: &Request, now: i64) -> Result<Option<(FencingToken, u32)>> {
    let key = req.key.as_str();
    let rows = holders(tx, key, now)?;
    let admission = admit(
        key,
        rows.iter().map(|r| (r.owner.as_str(), r.mode)),
        req.owner.as_str(),
        req.mode,
    )?;
    let expires_at = now.saturating_add(ms(req.ttl));
    let granted = match admission {
        Admission::Reenter { index } => {
            let row = &rows[index];
            let add = u32::from(req.reentrant);
            tx.prepare_cached(
                "UPDATE fencelock_holders SET holds = holds + ?4, expires_at = max(expires_at, ?3)
                 WHERE key = ?1 AND owner = ?2",
            )
            .and_then(|mut s| s.execute(params![key, req.owner.as_str(), expires_at, add]))
            .map_err(db_err)?;
            Some((FencingToken::new(row.token), row.holds.saturating_add(add)))
        }
        Admission::Grant => {
            let fence: i64 = tx
                .prepare_cached(
                    "INSERT INTO fencelock_locks (key, fence) VALUES (?1, ?2)
                     ON CONFLICT (key) DO UPDATE SET fence = max(fence + 1, excluded.fence)
                     RETURNING fence",
                )
                .and_then(|mut s| s.query_row(params![key, token_floor()], |r| r.get(0)))
                .map_err(db_err)?;
            tx.prepare_cached(
                "INSERT INTO fencelock_holders (key, owner, mode, holds, token, expires_at, acquired_at)
                 VALUES (?1, ?2, ?3, 1, ?4, ?5, ?6)",
            )
            .and_then(|mut s| {
                s.execute(params![key, req.owner.as_str(), req.mode.as_label(), fence, expires_at, now])
            })
            .map_err(db_err)?;
            Some((FencingToken::new(u64::try_from(fence).unwrap_or(0)), 1))
        }
        // Busy (and any future admission kind): nothing changes.
        _ => None,
    };
    Ok(granted)
}

/// A read-only check for polling waiters: `Some(time until the earliest
/// conflicting holder expires)` while `req` would be refused, `None` when it
/// might be granted.
pub(crate) fn busy_for(conn: &mut Connection, req: &Request) -> Result<Option<Duration>> {
    let now = now_ms();
    let rows = holders(conn, req.key.as_str(), now)?;
    let admission = admit(
        req.key.as_str(),
        rows.iter().map(|r| (r.owner.as_str(), r.mode)),
        req.owner.as_str(),
        req.mode,
    )?;
    if admission != Admission::Busy {
        return Ok(None);
    }
    let earliest = rows.iter().map(|r| r.expires_at).min().unwrap_or(now);
    Ok(Some(Duration::from_millis(
        u64::try_from(earliest.saturating_sub(now)).unwrap_or(0),
    )))
}

pub(crate) fn renew(
    conn: &mut Connection,
    leases: &[LeaseRef],
    busy_timeout: Duration,
) -> Result<Vec<Renewal>> {
    let shortest = leases.iter().map(|l| l.ttl).min().unwrap_or(busy_timeout);
    busy_timeout_for(conn, busy_timeout, shortest)?;
    let tx = immediate(conn)?;
    let now = now_ms();
    let mut out = Vec::with_capacity(leases.len());
    {
        let mut stmt = tx
            .prepare_cached(
                // The row of this grant: the owner's name and its token (an
                // owner whose hold was broken may hold the key again, anew).
                "UPDATE fencelock_holders SET expires_at = MAX(expires_at, ?3)
                 WHERE key = ?1 AND owner = ?2 AND expires_at > ?4 AND token = ?5",
            )
            .map_err(db_err)?;
        for lease in leases {
            let changed = stmt
                .execute(params![
                    lease.key.as_str(),
                    lease.owner.as_str(),
                    now.saturating_add(ms(lease.ttl)),
                    now,
                    token_of(lease)
                ])
                .map_err(db_err)?;
            out.push(if changed == 1 {
                Renewal::Held { ttl: lease.ttl }
            } else {
                Renewal::Lost {
                    reason: "no unexpired holder row for this grant".into(),
                }
            });
        }
    }
    tx.commit().map_err(db_err)?;
    Ok(out)
}

/// Releases one hold; if that lets the key go and `next` is given, grants it to
/// `next` in the same transaction.
pub(crate) fn release(
    conn: &mut Connection,
    lease: &LeaseRef,
    next: Option<&Request>,
    busy_timeout: Duration,
) -> Result<(Released, Option<Granted>)> {
    busy_timeout_for(conn, busy_timeout, Duration::MAX)?;
    let tx = immediate(conn)?;
    let began = tokio::time::Instant::now();
    let now = now_ms();
    let key = lease.key.as_str();
    let owner = lease.owner.as_str();
    purge(&tx, key, now)?;
    let holds: Option<i64> = tx
        .prepare_cached(
            "SELECT holds FROM fencelock_holders WHERE key = ?1 AND owner = ?2 AND token = ?3",
        )
        .and_then(|mut s| {
            s.query_row(params![key, owner, token_of(lease)], |r| r.get(0))
                .optional()
        })
        .map_err(db_err)?;
    let Some(holds) = holds else {
        return Err(Error::NotHeld {
            key: key.to_string(),
            owner: owner.to_string(),
        });
    };
    let sql = if holds > 1 {
        "UPDATE fencelock_holders SET holds = holds - 1 WHERE key = ?1 AND owner = ?2"
    } else {
        "DELETE FROM fencelock_holders WHERE key = ?1 AND owner = ?2"
    };
    tx.prepare_cached(sql)
        .and_then(|mut s| s.execute(params![key, owner]))
        .map_err(db_err)?;
    let handed = match next {
        Some(next) if holds == 1 && next.key == lease.key => grant(&tx, next, now)?,
        _ => None,
    };
    tx.commit().map_err(db_err)?;
    Ok((
        Released::new(u32::try_from(holds - 1).unwrap_or(0)),
        handed.map(|(t, h)| (t, h, began)),
    ))
}

/// The token of `lease` as stored (`NULL`, matching no row, if it has none).
fn token_of(lease: &LeaseRef) -> Option<i64> {
    lease.token.and_then(|t| i64::try_from(t.get()).ok())
}

pub(crate) fn force_release(conn: &mut Connection, key: &Key) -> Result<()> {
    let tx = immediate(conn)?;
    tx.execute(
        "DELETE FROM fencelock_holders WHERE key = ?1",
        params![key.as_str()],
    )
    .map_err(db_err)?;
    tx.commit().map_err(db_err)
}

fn fence(conn: &Connection, key: &str) -> Result<Option<u64>> {
    conn.prepare_cached("SELECT fence FROM fencelock_locks WHERE key = ?1")
        .and_then(|mut s| s.query_row(params![key], |r| r.get::<_, i64>(0)).optional())
        .map(|f| f.map(|f| u64::try_from(f).unwrap_or(0)))
        .map_err(db_err)
}

fn info(conn: &Connection, key: &str, now: i64) -> Result<Option<LockInfo>> {
    let rows = holders(conn, key, now)?;
    let fence = fence(conn, key)?;
    if rows.is_empty() && fence.is_none() {
        return Ok(None);
    }
    let holders = rows
        .into_iter()
        .map(|r| {
            let left = u64::try_from(r.expires_at.saturating_sub(now)).unwrap_or(0);
            HolderInfo::new(
                r.owner,
                r.mode,
                r.holds,
                Some(FencingToken::new(r.token)),
                Some(Duration::from_millis(left)),
            )
        })
        .collect();
    Ok(Some(LockInfo::new(
        key,
        holders,
        fence.map(FencingToken::new),
    )))
}

pub(crate) fn inspect(conn: &mut Connection, key: &Key) -> Result<Option<LockInfo>> {
    info(conn, key.as_str(), now_ms())
}

pub(crate) fn list(conn: &mut Connection, prefix: &str) -> Result<Vec<LockInfo>> {
    let now = now_ms();
    let keys: Vec<String> = {
        let mut stmt = conn
            .prepare_cached(
                "SELECT DISTINCT key FROM fencelock_holders
                 WHERE expires_at > ?2 AND substr(key, 1, length(?1)) = ?1 ORDER BY key",
            )
            .map_err(db_err)?;
        stmt.query_map(params![prefix, now], |r| r.get(0))
            .map_err(db_err)?
            .collect::<rusqlite::Result<_>>()
            .map_err(db_err)?
    };
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        if let Some(i) = info(conn, &key, now)? {
            out.push(i);
        }
    }
    Ok(out)
}
