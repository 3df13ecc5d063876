#!/usr/bin/env bash
# One user's jobs against everyone's node (issue 40, point 3): JOBS jobs
# without GPUs, each asking for its outputs to be pushed every second,
# against a store of INDEX index objects. Measures another user's
# `labrun ps` (p50, p99, max), labd's peak memory, and how often outputs
# pushes land.
#   bench/outputs-load.sh [--bin DIR] [--jobs N] [--index N] [--seconds S]
# Writes bench/results/outputs-load.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin="" jobs=1000 index=10000 seconds=150
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --index) index="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    *) echo "outputs-load.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  cargo build --release --locked --bins
  bin=target/release
fi
bin="$(cd "$bin" && pwd)"

work="$(mktemp -d)"
marker="900.$$"
labd_pid=""
cleanup() {
  [ -n "$labd_pid" ] && kill "$labd_pid" 2> /dev/null || true
  pkill -f "sleep $marker" 2> /dev/null || true
  rm -rf "$work"
}
[ -n "${KEEP:-}" ] || trap cleanup EXIT
store="$work/store"
export HOME="$work/home" LABSYNC_STORE="file://$store" LABSYNC_CACHE="$work/cache"
mkdir -p "$HOME" "$work/seed" "$work/code"
echo seed > "$work/seed/f"
"$bin/labsync" push "$work/seed" --name seed > /dev/null
start=$(date +%s.%N)
"$bin/index-objects" "$store" "$index"
made=$(echo "$(date +%s.%N) - $start" | bc)

cat > "$work/labd.toml" <<EOF
listen = "unix://$work/labd.sock"
state_dir = "$work/state"
store = "file://$store"
cache_dir = "$work/labd-cache"
run_as = "labd"
max_cpu_jobs_per_user = $((jobs + 10))
max_queued_per_user = $((jobs + 10))
[tokens]
alice = "tok-alice-outputs-load-0123456789"
bob = "tok-bob-outputs-load-0123456789"
EOF
chmod 600 "$work/labd.toml"
LABD_LOG=info "$bin/labd" --config "$work/labd.toml" > "$work/labd.log" 2>&1 &
labd_pid=$!
for _ in $(seq 100); do [ -S "$work/labd.sock" ] && break; sleep 0.1; done
export LABRUN_LABD="unix://$work/labd.sock"

# alice's jobs, eight submissions at a time.
start=$(date +%s.%N)
seq "$jobs" | (cd "$work/code" && LABRUN_TOKEN=tok-alice-outputs-load-0123456789 \
  xargs -P 8 -I{} "$bin/labrun" -d --gpus 0 --outputs ckpt --outputs-every 1s -- \
  bash -c "mkdir -p ckpt; echo \$LABRUN_JOB_ID > ckpt/f; exec sleep $marker" > "$work/submit.log" 2>&1)
submitted=$(echo "$(date +%s.%N) - $start" | bc)

# bob's `labrun ps` every 200 ms, and labd's memory every second, for $seconds s.
lat="$work/ps.txt"
: > "$lat"
end=$(( $(date +%s) + seconds ))
rss_max=0
next_rss=0
while [ "$(date +%s)" -lt "$end" ]; do
  t0=$(date +%s%N)
  LABRUN_TOKEN=tok-bob-outputs-load-0123456789 "$bin/labrun" ps > /dev/null
  t1=$(date +%s%N)
  echo $(( (t1 - t0) / 1000000 )) >> "$lat"
  if [ "$(date +%s)" -ge "$next_rss" ]; then
    rss=$(sed -n 's/^VmRSS:\s*\([0-9]*\) kB/\1/p' "/proc/$labd_pid/status")
    [ "${rss:-0}" -gt "$rss_max" ] && rss_max=$rss
    next_rss=$(( $(date +%s) + 1 ))
  fi
  sleep 0.2
done
hwm=$(sed -n 's/^VmHWM:\s*\([0-9]*\) kB/\1/p' "/proc/$labd_pid/status")
running=$(LABRUN_TOKEN=tok-bob-outputs-load-0123456789 "$bin/labrun" ps --all --json |
  python3 -c 'import json,sys; print(sum(1 for j in json.load(sys.stdin) if j["user"] == "alice" and j["state"].get("state") == "running"))')
read -r n p50 p99 pmax < <(sort -n "$lat" | python3 -c '
import sys
v = [int(l) for l in sys.stdin]
q = lambda f: v[min(len(v) - 1, int(f * len(v)))]
print(len(v), q(0.5), q(0.99), v[-1])')
# Outputs pushes that landed, per second of labd's log.
read -r saved busiest < <(python3 - "$work/labd.log" <<'PY'
import collections, re, sys
per = collections.Counter()
for line in open(sys.argv[1], errors="replace"):
    if "outputs saved as" in line:
        m = re.search(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d", line)
        per[m.group(0) if m else "?"] += 1
print(sum(per.values()), max(per.values()) if per else 0)
PY
)

out=bench/results/outputs-load.md
mkdir -p bench/results
{
  echo "# One user's jobs against everyone's node"
  echo
  echo "Recorded $(date -u +%Y-%m-%d) on $(nproc) cores, binaries in \`${bin#"$PWD"/}\`"
  echo "($(git rev-parse --short HEAD 2> /dev/null || echo unknown)). A store of $index index"
  echo "objects (made in $(printf %.1f "$made") s); alice submits $jobs jobs without GPUs, each"
  echo "\`--outputs-every 1s\` (the node's floor makes it 60 s), in $(printf %.1f "$submitted") s; for"
  echo "$seconds s bob runs \`labrun ps\` every 200 ms."
  echo
  echo "| measure | value | target |"
  echo "|---|---|---|"
  echo "| alice's jobs running at the end | $running | $jobs |"
  echo "| bob's \`labrun ps\`: calls, p50, p99, max | $n, $p50 ms, $p99 ms, $pmax ms | p99 < 200 ms |"
  echo "| labd's peak RSS (VmHWM; most seen by sampling) | $((hwm / 1024)) MiB ($((rss_max / 1024)) MiB) | < 256 MB |"
  echo "| outputs pushes landed; most in one second | $saved; $busiest | at most 2 at once (OUTPUTS_AT_ONCE) |"
} > "$out"
cat "$out"
