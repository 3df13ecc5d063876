#!/usr/bin/env bash
# labrun latency benchmark: builds the release binaries and runs labrun-bench.
#   bench/labrun.sh [--reps N] [--data-mb MB] [--work DIR] [--out PATH]
# Writes bench/results/labrun.md and .json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
command -v python3 > /dev/null || { echo "labrun.sh: needs python3 (train.py)"; exit 1; }
cargo build --release --locked --bins
exec target/release/labrun-bench --bin target/release "$@"
