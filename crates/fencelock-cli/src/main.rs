//! The `fencelock` command: `run`, `demo`, `bench`, `torture`, `status`, `list`.

mod bench;
mod bench_held;
mod bench_procs;
mod cli;
mod demo;
mod exit;
#[cfg(feature = "heap-count")]
mod heap_count;
mod inspect;
mod plot;
mod process_tree;
mod run;
mod torture;
mod watch;

use std::process::ExitCode;
use std::time::Duration;

use clap::error::ErrorKind;
use clap::{CommandFactory, FromArgMatches};

use crate::cli::{Cli, Command};

#[cfg(feature = "heap-count")]
#[global_allocator]
static ALLOC: heap_count::CountingAlloc = heap_count::CountingAlloc;

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("FENCELOCK_LOG")
                // Without FENCELOCK_LOG only fencelock's own warnings: a
                // driver's (sqlx's slow statements, a pool's broken idle
                // connection) are not the user's business.
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("fencelock=warn")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let version = format!(
        "{} (backends: {})",
        env!("CARGO_PKG_VERSION"),
        fencelock::compiled_backends().join(", ")
    );
    let parsed = Cli::command()
        .version(version)
        .try_get_matches()
        .and_then(|m| Cli::from_arg_matches(&m));
    let cli = match parsed {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return match e.kind() {
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => ExitCode::SUCCESS,
                _ => ExitCode::from(exit::USAGE),
            };
        }
    };
    // The reaper needs no runtime: it waits on a pipe.
    if let Command::Reap(args) = &cli.command {
        return ExitCode::from(process_tree::reap(args.pgid));
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fencelock: cannot start the async runtime: {e}");
            return ExitCode::from(exit::FAILURE);
        }
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Run(args) => run::run(args).await,
            Command::Demo(args) => demo::demo(args).await,
            Command::DemoBuyer(args) => demo::buyer(args).await,
            Command::Bench(args) => bench::bench(args).await,
            Command::BenchWorker(args) => bench_procs::worker(args).await,
            Command::Status(args) => inspect::status(args).await,
            Command::List(args) => inspect::list(args).await,
            Command::Torture(args) => torture::torture(args).await,
            Command::TortureClient(args) => torture::client(args).await,
            Command::Reap(_) => exit::FAILURE,
        }
    });
    // Do not wait for stuck blocking work (a busy database) at exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    ExitCode::from(code)
}
