#!/usr/bin/env bash
# The test command (README, .ci/run): works on a fresh machine with only the
# Rust toolchain. Installs the S3-compatible test servers if they are missing
# (and cargo-generate-rpm, which the install tests build the .rpm with)
# (s3s-fs here; moto, ministack and s3rver by scripts/s3-servers.sh) and, as
# root on Debian, Slurm, Chromium and promtool; the tests start their own instances on 127.0.0.1
# (random ports).
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
if ! cargo generate-rpm --help >/dev/null 2>&1; then
  # The install tests build the .rpm with scripts/package.sh.
  echo "test.sh: installing cargo-generate-rpm 0.21.1 (builds the .rpm, ~3 min)" >&2
  cargo install cargo-generate-rpm@0.21.1 --locked
fi
# The other servers of the compatibility matrix (moto, ministack, s3rver).
# shellcheck source=scripts/s3-servers.sh
. scripts/s3-servers.sh

# Slurm for the Slurm backend's tests (Debian's packages; the tests start
# their own munged, slurmctld and slurmd on 127.0.0.1). Where it cannot be
# installed those tests say they were skipped, and so does the end of this run.
slurm_missing() {
  local p
  for p in munged mungekey slurmctld slurmd sbatch squeue scontrol scancel; do
    if ! PATH="$PATH:/usr/sbin:/sbin" command -v "$p" >/dev/null 2>&1; then
      echo "$p"
      return 0
    fi
  done
  return 1
}
slurm_note=""
if slurm_missing >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing Slurm and munge (Debian's packages) for the Slurm tests" >&2
    pkgs=(munge slurmctld slurmd slurm-client)
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${pkgs[@]}" >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q "${pkgs[@]}" >/dev/null 2>&1; } ||
      echo "test.sh: could not install Slurm" >&2
  fi
  if missing="$(slurm_missing)"; then
    slurm_note="the Slurm tests were SKIPPED: $missing is not installed (as root on Debian: apt-get install munge slurmctld slurmd slurm-client)"
  fi
fi

# Headless Chromium and ChromeDriver for the web page's tests, and promtool
# (Debian's prometheus package) for the metrics' (tests/cluster/web.rs): they
# fail under CI=true without them.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] || [ ! -x /usr/bin/promtool ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "test.sh: installing chromium, chromium-driver and prometheus (promtool) for the web tests (~1 min)" >&2
    pkgs=(chromium chromium-driver prometheus)
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 &&
        apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null 2>&1; } ||
      echo "test.sh: could not install chromium, chromium-driver and prometheus" >&2
  fi
fi

# The release before protocol versions (labsync 0.1.0), for the rolling-upgrade
# test: its labd built once from its commit, in a target folder of its own (a
# shared one would put its binary where this build's labd goes).
old_rev=2ffb0a63fd7c357e7ce16ab5d8f57fe2399f1d51
old_labd="target/old-labd/labd-0.1.0"
if [ ! -x "$old_labd" ]; then
  if ! git cat-file -e "$old_rev^{commit}" 2>/dev/null; then
    echo "test.sh: commit $old_rev (labsync 0.1.0) is not in this clone: the rolling-upgrade test needs the history (git fetch --unshallow)" >&2
    exit 1
  fi
  echo "test.sh: building labd 0.1.0 (commit ${old_rev:0:7}) for the rolling-upgrade test (~8 min, once)" >&2
  rm -rf target/old-labd/src
  mkdir -p target/old-labd/src
  git archive "$old_rev" | tar -x -C target/old-labd/src
  (cd target/old-labd/src && CARGO_TARGET_DIR="$PWD/../build" cargo build --locked -q -p labsync-cli --bin labd)
  cp target/old-labd/build/debug/labd "$old_labd"
fi
LABSYNC_OLD_LABD="$PWD/$old_labd"
export LABSYNC_OLD_LABD

status=0
cargo test --workspace --locked "$@" || status=$?
# The README's install from source: `cargo install` of the CLI crate gives the
# three tools (here into a throw-away root, from this build's artifacts).
if [ "$#" = 0 ]; then
  inst="$(mktemp -d)"
  if cargo install --locked --debug -q --path crates/cli --root "$inst" --target-dir target &&
    "$inst/bin/labd" --version && "$inst/bin/labrun" --version && "$inst/bin/labsync" --version; then
    echo "test.sh: cargo install --path crates/cli installs labsync, labrun and labd" >&2
  else
    echo "test.sh: cargo install --path crates/cli FAILED" >&2
    status=1
  fi
  rm -rf "$inst"
fi
if [ -n "$slurm_note" ]; then
  echo "test.sh: $slurm_note" >&2
fi
exit "$status"
