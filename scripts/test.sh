#!/usr/bin/env bash
# The whole test suite against real servers: the README's test command and what
# CI runs. Starts (and if needed installs) every server first.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== services"
scripts/services.sh

echo "== format"
cargo fmt --all -- --check

echo "== clippy"
cargo clippy --workspace --all-targets --all-features -- -D warnings

echo "== tests"
cargo test --workspace --all-features

echo "== examples (the embedded default: each runs to its end)"
for ex in crates/fencelock/examples/*.rs; do
    name=$(basename "$ex" .rs)
    cargo run -q -p fencelock --all-features --example "$name" >/dev/null
done

echo "== shuttle (the in-process line under shuttle's schedulers: docs/SAFETY.md §3)"
RUSTFLAGS="--cfg shuttle" cargo test -p fencelock-core --lib --release \
    --target-dir target/shuttle shuttle_tests

echo "== torture (a short fault campaign per backend, fixed seeds)"
FENCELOCK_BIN=target/debug/fencelock scripts/torture.sh --ci

echo "== docs"
RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --all-features

echo "== all tests passed"
