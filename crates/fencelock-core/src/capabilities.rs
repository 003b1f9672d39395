//! What a backend can do.

/// The features a backend offers; the conformance suite and the CLI switch on them.
///
/// Build one with [`Capabilities::NONE`] and the `with_*` methods (the struct is
/// `#[non_exhaustive]` so new capabilities can be added).
///
/// # Examples
///
/// ```
/// use fencelock_core::Capabilities;
///
/// let caps = Capabilities::NONE.with_fencing(true).with_ttl(true);
/// assert!(caps.fencing && !caps.shared);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Capabilities {
    /// Grants carry a [`FencingToken`](crate::FencingToken) that strictly increases per key.
    pub fencing: bool,
    /// [`Mode::Shared`](crate::Mode::Shared) is supported.
    pub shared: bool,
    /// [`Mode::Semaphore`](crate::Mode::Semaphore) is supported.
    pub semaphore: bool,
    /// The same owner may acquire a key again (hold count, same token).
    pub reentrant: bool,
    /// Waiters are woken by the backend's own notification, not only by polling.
    pub native_wait: bool,
    /// Holds expire after their TTL unless renewed.
    pub ttl: bool,
    /// [`Backend::inspect`](crate::Backend::inspect) and `list` work.
    pub inspect: bool,
    /// Waiters are granted in arrival order.
    pub fair: bool,
    /// Locks are shared by separate processes (false for the in-memory backend).
    pub cross_process: bool,
}

impl Capabilities {
    /// No capability at all.
    pub const NONE: Capabilities = Capabilities {
        fencing: false,
        shared: false,
        semaphore: false,
        reentrant: false,
        native_wait: false,
        ttl: false,
        inspect: false,
        fair: false,
        cross_process: false,
    };

    /// Sets [`Capabilities::fencing`].
    pub const fn with_fencing(mut self, v: bool) -> Self {
        self.fencing = v;
        self
    }
    /// Sets [`Capabilities::shared`].
    pub const fn with_shared(mut self, v: bool) -> Self {
        self.shared = v;
        self
    }
    /// Sets [`Capabilities::semaphore`].
    pub const fn with_semaphore(mut self, v: bool) -> Self {
        self.semaphore = v;
        self
    }
    /// Sets [`Capabilities::reentrant`].
    pub const fn with_reentrant(mut self, v: bool) -> Self {
        self.reentrant = v;
        self
    }
    /// Sets [`Capabilities::native_wait`].
    pub const fn with_native_wait(mut self, v: bool) -> Self {
        self.native_wait = v;
        self
    }
    /// Sets [`Capabilities::ttl`].
    pub const fn with_ttl(mut self, v: bool) -> Self {
        self.ttl = v;
        self
    }
    /// Sets [`Capabilities::inspect`].
    pub const fn with_inspect(mut self, v: bool) -> Self {
        self.inspect = v;
        self
    }
    /// Sets [`Capabilities::fair`].
    pub const fn with_fair(mut self, v: bool) -> Self {
        self.fair = v;
        self
    }
    /// Sets [`Capabilities::cross_process`].
    pub const fn with_cross_process(mut self, v: bool) -> Self {
        self.cross_process = v;
        self
    }

    /// Whether `mode` is supported.
    pub fn supports(&self, mode: crate::Mode) -> bool {
        match mode {
            crate::Mode::Exclusive => true,
            crate::Mode::Shared => self.shared,
            crate::Mode::Semaphore { .. } => self.semaphore,
        }
    }

    /// The names of the capabilities that are on, for `--version` and reports.
    pub fn names(&self) -> Vec<&'static str> {
        let all = [
            ("fencing", self.fencing),
            ("shared", self.shared),
            ("semaphore", self.semaphore),
            ("reentrant", self.reentrant),
            ("native_wait", self.native_wait),
            ("ttl", self.ttl),
            ("inspect", self.inspect),
            ("fair", self.fair),
            ("cross_process", self.cross_process),
        ];
        all.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect()
    }
}
