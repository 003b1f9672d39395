//! The fencing token of a Redlock grant: a quorum max-register, floored at
//! the instances' clocks (see the module docs of `redlock` and
//! `docs/SAFETY.md` §1, whose model abstracts `propose`, `observe` and
//! `settle_token`).

use super::*;

impl RedlockBackend {
    /// A floor for the next token, proposed to every instance so that they can
    /// agree on it in the same round trip: the latest instance clock reading,
    /// plus the time since it arrived, plus [`PROPOSAL_MARGIN`]; 0 (no floor)
    /// without a reading of the last [`FRESH_READING`]. No client wall clock
    /// enters it, so it exceeds the fastest instance clock by at most the
    /// margin (plus this host's monotonic clock error over one second).
    pub(super) fn propose(&self) -> u64 {
        let reading = *self.inner.reading.lock().unwrap_or_else(|p| p.into_inner());
        match reading {
            Some((us, at)) if at.elapsed() <= FRESH_READING => {
                us + (at.elapsed() + PROPOSAL_MARGIN).as_micros() as u64
            }
            _ => 0,
        }
    }

    /// Records instance clock readings (µs) that just arrived.
    pub(super) fn observe(&self, readings: impl IntoIterator<Item = u64>) {
        let Some(us) = readings.into_iter().max().filter(|us| *us > 0) else {
            return;
        };
        let now = Instant::now();
        let mut reading = self.inner.reading.lock().unwrap_or_else(|p| p.into_inner());
        // Keep the reading that stands for the later instance time now.
        let newer = reading.is_none_or(|(old, at)| {
            old + now.saturating_duration_since(at).as_micros() as u64 <= us
        });
        if newer {
            *reading = Some((us, now));
        }
    }

    /// Turns the answers of a majority into the grant's token (the quorum
    /// max-register): the largest answer. If every answer is that one, the
    /// majority already stores it; otherwise it is written back to a majority.
    /// `None` if that write-back did not reach a majority.
    pub(super) async fn settle_token(
        &self,
        req: &Request,
        op: &Op,
        answers: &[u64],
        timeout: Duration,
    ) -> Option<u64> {
        let token = answers.iter().copied().max()?;
        if answers.iter().all(|t| *t == token) {
            return Some(token);
        }
        let raised = self
            .on_all(timeout, Skip::Down, |_, n| {
                n.raise_fence(&req.key, req.owner.as_str(), op, token)
            })
            .await;
        let acks = raised
            .iter()
            .filter(|a| matches!(a, Answer::Ok(())))
            .count();
        (acks >= self.quorum()).then_some(token)
    }
}
