//! The `fencelock` command-line tool (filled in by the CLI issue).

fn main() {
    println!(
        "fencelock {} — backends: {}",
        env!("CARGO_PKG_VERSION"),
        fencelock::compiled_backends().join(", ")
    );
}
