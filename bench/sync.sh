#!/usr/bin/env bash
# Runs the labsync sync benchmark end to end:
#   bench/sync.sh [--scale F] [--out PATH] [other sync-bench options]
# Installs the peer tools from Debian packages when missing, builds labsync
# (when this is the labsync workspace) and runs `sync-bench`.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# In the labsync repo this script lives in bench/ and the workspace root is
# one level up; as a standalone crate the crate dir is the root.
if [[ -f "$HERE/../Cargo.toml" ]] && grep -q '^\[workspace\]' "$HERE/../Cargo.toml"; then
  ROOT="$(cd "$HERE/.." && pwd)"
  IN_WORKSPACE=1
else
  ROOT="$HERE"
  IN_WORKSPACE=0
fi
cd "$ROOT"

# Debian package -> command it provides. strace backs the fsync column.
declare -A NEEDS=([rsync]=rsync [rclone]=rclone [restic]=restic [borgbackup]=borg
                  [casync]=casync [time]=/usr/bin/time [strace]=strace)
missing=()
for pkg in "${!NEEDS[@]}"; do
  command -v "${NEEDS[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "sync.sh: installing ${missing[*]}" >&2
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

args=("$@")
has_out=0 has_labsync=0
for a in "${args[@]}"; do
  [[ $a == --out || $a == --out=* ]] && has_out=1
  [[ $a == --labsync || $a == --labsync=* ]] && has_labsync=1
done
# Default report location is next to this script, in both layouts.
((has_out)) || args+=(--out "$HERE/results/sync.md")
# Follow CARGO_TARGET_DIR, where `cargo build` below puts the binary.
((has_labsync)) || args+=(--labsync "${CARGO_TARGET_DIR:-$ROOT/target}/release/labsync")

if ((IN_WORKSPACE)); then
  # Benchmark the current source, not a stale binary. A failed build is not
  # fatal: sync-bench then reports labsync as "missing" and runs the peers.
  cargo build --release --bin labsync || echo "sync.sh: labsync build failed; its rows will read 'missing'" >&2
fi

exec cargo run --release -p labsync-bench --bin sync-bench -- "${args[@]}"
