#!/usr/bin/env bash
# labd under load: builds the release binaries and runs labd-load.
#   bench/labd-load.sh [--jobs N] [--seconds S] [--clients C] [--users U] [--nodes K] [--work DIR] [--out PATH]
# Writes bench/results/labd-load.md and .json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cargo build --release --locked --bins
exec target/release/labd-load --bin target/release "$@"
