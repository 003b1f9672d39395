//! Which etcd errors are worth another try, and how they read.

use super::*;

/// Failures worth another try: no leader for a moment, a member gone.
pub(crate) fn transient(e: &etcd_client::Error) -> bool {
    // gRPC status codes: CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE.
    const RETRYABLE: [i32; 3] = [1, 4, 14];
    match e {
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        etcd_client::Error::GRpcStatus(s) => {
            RETRYABLE.contains(&(s.code() as i32))
                || s.message().contains("leader")
                || s.message().contains("transport error")
        }
        _ => false,
    }
}

pub(crate) fn etcd_err(e: etcd_client::Error, addr: &str) -> Error {
    let err = match &e {
        // PERMISSION_DENIED, UNAUTHENTICATED, and etcd's own wordings.
        etcd_client::Error::GRpcStatus(s)
            if [7, 16].contains(&(s.code() as i32))
                || ["auth", "permission", "user name"]
                    .iter()
                    .any(|w| s.message().contains(w)) =>
        {
            Error::login_refused(NAME, addr, s.message())
        }
        etcd_client::Error::GRpcStatus(s) if transient(&e) => {
            Error::connection(NAME, addr, s.message())
        }
        _ if transient(&e) => Error::connection(NAME, addr, &e),
        _ => Error::backend(NAME, &e),
    };
    err.with_source(e)
}
