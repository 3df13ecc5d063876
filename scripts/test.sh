#!/usr/bin/env bash
# The test command (README, .ci/run): works on a fresh machine with only the
# Rust toolchain. Installs the S3-compatible test servers if they are missing
# (s3s-fs here; moto, ministack and s3rver by scripts/s3-servers.sh); the
# tests start their own instances on 127.0.0.1 (random ports).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v s3s-fs >/dev/null 2>&1; then
  # s3s-fs honours conditional create (If-None-Match), which the ref race tests
  # need; 0.14.1 is the last release that builds with this toolchain.
  echo "test.sh: installing s3s-fs 0.14.1 (S3 server for the tests, ~2 min)" >&2
  cargo install s3s-fs@0.14.1 --locked --features binary
fi
LABSYNC_S3S_FS="$(command -v s3s-fs)"
export LABSYNC_S3S_FS
# The other servers of the compatibility matrix (moto, ministack, s3rver).
# shellcheck source=scripts/s3-servers.sh
. scripts/s3-servers.sh

cargo test --workspace --locked "$@"
