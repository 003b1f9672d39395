//! `fencelock torture` and its hidden client subcommand; the engine is the
//! `fencelock-torture` crate.

use crate::cli::{TortureArgs, TortureClientArgs};
use crate::exit;

/// The controller.
pub async fn torture(args: TortureArgs) -> u8 {
    let exe = match std::env::current_exe() {
        Ok(p) => p.display().to_string(),
        Err(e) => {
            eprintln!("fencelock: cannot find this program to start clients: {e}");
            return exit::FAILURE;
        }
    };
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let faults = args.faults.0;
    let cfg = fencelock_torture::Config {
        backend: args.backend,
        spawn: args.spawn,
        clients: args.clients,
        duration: args.duration,
        faults,
        seed,
        ttl: args.ttl,
        ignore_lost: args.ignore_lost,
        client_command: vec![exe, "__torture-client".into()],
        history: args.history,
    };
    eprintln!(
        "fencelock torture: seed {seed}, {} clients, {}",
        cfg.clients,
        humantime::format_duration(cfg.duration)
    );
    match fencelock_torture::run(cfg).await {
        Ok(report) => {
            eprint!("{}", report.to_text());
            if args.json {
                println!("{}", report.to_json());
            }
            if report.findings.violations() > 0 {
                exit::FAILURE
            } else {
                0
            }
        }
        Err(e) => {
            eprintln!("fencelock torture: {e}");
            exit::UNAVAILABLE
        }
    }
}

/// One client.
pub async fn client(args: TortureClientArgs) -> u8 {
    fencelock_torture::client(fencelock_torture::ClientConfig {
        backend: args.backend,
        name: args.name,
        register: args.register,
        ttl: args.ttl,
        seed: args.seed,
        ignore_lost: args.ignore_lost,
        prefix: args.prefix,
    })
    .await
}
