//! A job that must run on one instance at a time (a "singleton cron"): at
//! each tick an instance tries the lock once and skips the run if another
//! instance has it.
//!
//! `cargo run -p fencelock --example singleton_job`

fn token(guard: &fencelock::Guard) -> String {
    guard.token().map_or("none".into(), |t| t.to_string())
}

#[tokio::main]
async fn main() -> fencelock::Result<()> {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    // Two instances of the service, each with its own connection.
    let a = fencelock::connect(&url).await?;
    let b = fencelock::connect(&url).await?;

    let job = a.lock("jobs/nightly-report").try_acquire().await?;
    let job = job.expect("nobody runs the job yet");
    println!("A runs the job (token {})", token(&job));

    // B's tick comes while A still runs it: B skips this run.
    let skipped = b.lock("jobs/nightly-report").try_acquire().await?;
    assert!(skipped.is_none(), "two instances ran the job at once");
    println!("B skips: the job runs elsewhere");

    job.release().await?;
    // At the next tick the job is free again.
    let job = b.lock("jobs/nightly-report").try_acquire().await?;
    let job = job.expect("the job is free after A released it");
    println!("B runs the next one (token {})", token(&job));
    job.release().await
}
