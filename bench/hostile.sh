#!/usr/bin/env bash
# Planted objects (issue 40, point 2): a 4 GiB object under index/ and
# under snapshots/ of a store every member can write. Measures the peak
# memory (max RSS) of `labsync pull`, `labsync verify` and labd's outputs
# push over that store, each naming the refused key.
#   bench/hostile.sh [--bin DIR]    (default: target/release, built here)
# Writes bench/results/hostile.md.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    *) echo "hostile.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
if [ -z "$bin" ]; then
  cargo build --release --locked --bins
  bin=target/release
fi
bin="$(cd "$bin" && pwd)"
command -v /usr/bin/time > /dev/null || { echo "hostile.sh: needs GNU time (apt-get install time)" >&2; exit 1; }

work="$(mktemp -d)"
labd_pid=""
cleanup() {
  [ -n "$labd_pid" ] && kill "$labd_pid" 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
store="$work/store"
export HOME="$work/home" LABSYNC_STORE="file://$store" LABSYNC_CACHE="$work/cache"
mkdir -p "$HOME" "$work/ds"
# 64 MiB of data in 16 files, pushed as ds@v1.
for i in $(seq 16); do head -c 4194304 /dev/urandom > "$work/ds/f$i.bin"; done
"$bin/labsync" push "$work/ds" --name ds > /dev/null
snapshot="$("$bin/labsync" --json log ds | python3 -c 'import json,sys; print(json.load(sys.stdin)["versions"][0]["snapshot"])')"

# The planted objects: sparse files of 4 GiB (what a server would report).
plant() { mkdir -p "$(dirname "$store/$1")"; truncate -s 4G "$store/$1"; }
plant "index/$(printf 'ab%.0s' $(seq 32))"
plant "snapshots/$(printf 'cd%.0s' $(seq 32))"

# Max RSS (KiB) of one command, and whether its output names the key.
measure() {
  local what="$1" key="$2"; shift 2
  local out rss rc=0
  out="$( { /usr/bin/time -f 'MAXRSS %M' "$@" 2>&1; } 2>&1 )" || rc=$?
  rss="$(printf '%s\n' "$out" | sed -n 's/^MAXRSS //p' | tail -1)"
  local named=no
  printf '%s\n' "$out" | grep -q "$key" && named=yes
  printf '| %s | %s | %.1f MiB | %s |\n' "$what" "$rc" "$(echo "$rss / 1024" | bc -l)" "$named"
}

rows=()
rows+=("$(measure '`labsync pull ds`' "index/abab" "$bin/labsync" pull ds "$work/out1")")
rows+=("$(measure '`labsync verify`' "index/abab" "$bin/labsync" verify)")
rows+=("$(measure '`labsync gc --dry-run`' "index/abab" "$bin/labsync" gc --dry-run)")

# labd: a job whose outputs are pushed over the same store; labd's peak
# memory (VmHWM) after its final push.
mkdir -p "$work/labd"
cat > "$work/labd/labd.toml" <<EOF
listen = "unix://$work/labd/labd.sock"
state_dir = "$work/labd/state"
store = "file://$store"
cache_dir = "$work/labd/cache"
tick_ms = 50
run_as = "labd"
[tokens]
me = "tok-hostile-bench-0123456789"
EOF
chmod 600 "$work/labd/labd.toml"
LABD_LOG=info "$bin/labd" --config "$work/labd/labd.toml" > "$work/labd/labd.log" 2>&1 &
labd_pid=$!
for _ in $(seq 100); do [ -S "$work/labd/labd.sock" ] && break; sleep 0.1; done
export LABRUN_LABD="unix://$work/labd/labd.sock" LABRUN_TOKEN="tok-hostile-bench-0123456789"
mkdir -p "$work/code"
id="$(cd "$work/code" && "$bin/labrun" -d --gpus 0 --outputs ckpt -- bash -c 'mkdir -p ckpt; head -c 1048576 /dev/urandom > ckpt/model.pt')"
for _ in $(seq 600); do
  pending="$("$bin/labrun" ps --all --json | python3 -c "import json,sys; j=[j for j in json.load(sys.stdin) if j['id']=='$id'][0]; print(j['meta']['outputs_pending'])")"
  [ "$pending" = "False" ] && break
  sleep 0.1
done
hwm="$(sed -n 's/^VmHWM:\s*\([0-9]*\) kB/\1/p' "/proc/$labd_pid/status")"
saved="$("$bin/labrun" ps --all --json | python3 -c "import json,sys; j=[j for j in json.load(sys.stdin) if j['id']=='$id'][0]; print(j['meta']['outputs_saved'])")"
named=no; grep -q "index/abab" "$work/labd/labd.log" && named=yes
rows+=("$(printf '| labd, a job'"'"'s final outputs push (saved as `%s`) | - | %.1f MiB | %s |' "${saved%%#*}" "$(echo "$hwm / 1024" | bc -l)" "$named")")

out=bench/results/hostile.md
mkdir -p bench/results
{
  echo "# Planted 4 GiB objects: peak memory of each reader"
  echo
  echo "A store holding ds@v1 (64 MiB in 16 files, snapshot ${snapshot:0:12}) and two"
  echo "planted sparse objects of 4 GiB: \`index/abab…\` and \`snapshots/cdcd…\`."
  echo "Recorded $(date -u +%Y-%m-%d) on $(nproc) cores, binaries in \`${bin#"$PWD"/}\`"
  echo "($(git rev-parse --short HEAD 2> /dev/null || echo unknown))."
  echo
  echo "| command | exit | peak RSS | names the refused key |"
  echo "|---|---|---|---|"
  printf '%s\n' "${rows[@]}"
  echo
  echo "Before the bound (a whole read of every index object) the same pull"
  echo "needs more than 4 GiB and is killed under a 512 MiB heap limit"
  echo "(\`tests/e2e/hostile.rs\`). Exit 1 for verify is its report of the"
  echo "refused object, as intended."
} > "$out"
cat "$out"
