//! `fencelock status` and `fencelock list`.

use fencelock::{Error, LockInfo, Locker};

use crate::cli::{ListArgs, StatusArgs};
use crate::exit;

/// `println!` that treats a closed stdout (`fencelock status k | head -1`) as
/// the reader having seen enough: the process ends quietly, status 0, instead
/// of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout().lock(), $($arg)*) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                std::process::exit(0);
            }
            eprintln!("fencelock: cannot write the output: {e}");
            std::process::exit(i32::from(exit::FAILURE));
        }
    }};
}

fn print_holders(info: &LockInfo) {
    out!(
        "  {:<40} {:<12} {:>5} {:>10} {:>12}",
        "holder",
        "mode",
        "holds",
        "token",
        "expires in"
    );
    for h in &info.holders {
        out!(
            "  {:<40} {:<12} {:>5} {:>10} {:>12}",
            h.owner,
            h.mode.to_string(),
            h.holds,
            h.token.map_or("-".to_string(), |t| t.to_string()),
            h.expires_in
                .map_or("-".to_string(), |d| format!("{:.1}s", d.as_secs_f64()))
        );
    }
}

fn last_token(info: &LockInfo) -> String {
    info.last_token
        .map_or(String::new(), |t| format!(", last token {t}"))
}

pub(crate) fn unsupported_or(e: &Error, backend: &str) -> u8 {
    if let Error::Unsupported { .. } = e {
        eprintln!("fencelock: not supported by {backend}: it cannot inspect locks");
        return exit::FAILURE;
    }
    exit::report(e)
}

/// How long `status` and `list` give the backend to answer: a server that
/// does not (a frozen one, a silent link) ends them with 69.
const ANSWER: std::time::Duration = std::time::Duration::from_secs(10);

async fn connect(url: &str) -> Result<Locker, u8> {
    fencelock::connect_within(url, Some(ANSWER))
        .await
        .map_err(|e| exit::report(&e))
}

/// `ask`, or a connection error if the backend has not answered within
/// [`ANSWER`].
async fn answered<T>(
    locker: &Locker,
    ask: impl std::future::Future<Output = fencelock::Result<T>>,
) -> fencelock::Result<T> {
    tokio::time::timeout(ANSWER, ask).await.unwrap_or_else(|_| {
        Err(fencelock::Error::connection(
            locker.backend().name(),
            &locker.backend().address(),
            format!("no answer within {}", humantime::format_duration(ANSWER)),
        ))
    })
}

pub async fn status(args: StatusArgs) -> u8 {
    let locker = match connect(&args.backend.url()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    if args.watch {
        return crate::watch::watch(&locker, &args).await;
    }
    let name = locker.backend().name();
    let Some(key) = args.key.as_deref() else {
        return exit::USAGE;
    };
    if args.json {
        return match answered(&locker, locker.inspect(key)).await {
            Ok(info) => {
                let infos: Vec<LockInfo> = info.into_iter().collect();
                out!("{}", crate::watch::json(&infos));
                0
            }
            Err(e) => unsupported_or(&e, name),
        };
    }
    match answered(&locker, locker.inspect(key)).await {
        Ok(None) => {
            out!("{key}: free (never locked)");
            0
        }
        Ok(Some(info)) if info.holders.is_empty() => {
            out!("{key}: free{}", last_token(&info));
            0
        }
        Ok(Some(info)) => {
            out!("{key}: held{}", last_token(&info));
            print_holders(&info);
            0
        }
        Err(e) => unsupported_or(&e, name),
    }
}

pub async fn list(args: ListArgs) -> u8 {
    let locker = match connect(&args.backend.url()).await {
        Ok(l) => l,
        Err(code) => return code,
    };
    let name = locker.backend().name();
    match answered(&locker, locker.list(&args.prefix)).await {
        Ok(infos) if infos.is_empty() => {
            out!(
                "no held locks{}",
                if args.prefix.is_empty() {
                    String::new()
                } else {
                    format!(" under {:?}", args.prefix)
                }
            );
            0
        }
        Ok(infos) => {
            for info in &infos {
                out!("{}{}", info.key, last_token(info));
                print_holders(info);
            }
            0
        }
        Err(e) => unsupported_or(&e, name),
    }
}
