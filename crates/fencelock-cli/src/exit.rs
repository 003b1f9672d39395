//! Exit statuses of the CLI (ARCHITECTURE.md §5; the BSD sysexits values).

use fencelock::Error;

/// Bad usage or input: a bad flag, key, duration or URL.
pub const USAGE: u8 = 64;
/// The backend is unreachable (or answered with an error).
pub const UNAVAILABLE: u8 = 69;
/// The lock was not acquired within `--wait`.
pub const NOT_ACQUIRED: u8 = 75;
/// The lease was lost while the command ran.
pub const LOST: u8 = 76;
/// Something this program cannot classify; also `status`/`list` where the
/// backend cannot inspect.
pub const FAILURE: u8 = 1;

/// The exit status for an error of the library.
pub fn code_for(e: &Error) -> u8 {
    match e {
        Error::InvalidKey { .. } | Error::InvalidConfig(_) | Error::Unsupported { .. } => USAGE,
        Error::Timeout { .. } => NOT_ACQUIRED,
        Error::Lost { .. } | Error::NotHeld { .. } => LOST,
        Error::Connection { .. } | Error::Backend { .. } => UNAVAILABLE,
        _ => FAILURE,
    }
}

/// Prints `e` as one line on stderr and returns its exit status.
pub fn report(e: &Error) -> u8 {
    eprintln!("fencelock: {e}");
    code_for(e)
}
