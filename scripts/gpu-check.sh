#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: start labd on the real GPUs (NVML), hold
# 1 GiB on GPU 0 with a small CUDA process that labd did not start, and print
# `labrun status`. It must show the GPU's real memory and that process as
# FOREIGN (pid, user, MiB). Then the process ends, and a job leasing the GPU
# runs and sees it in CUDA_VISIBLE_DEVICES. Exits non-zero if any of that fails.
#
# LABSYNC_BIN=DIR uses binaries already built there.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ -z "${LABSYNC_BIN:-}" ]; then
  (cd "$root" && cargo build --release --locked -p labsync-cli)
  LABSYNC_BIN="$root/target/release"
fi
command -v python3 > /dev/null || { echo "gpu-check: needs python3 (for the CUDA holder)"; exit 1; }

work="$(mktemp -d)"
chmod 755 "$work"
holder_pid=""
labd_pid=""
cleanup() {
  [ -n "$holder_pid" ] && kill "$holder_pid" 2> /dev/null || true
  [ -n "$labd_pid" ] && kill "$labd_pid" 2> /dev/null || true
  wait 2> /dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

cat > "$work/labd.toml" <<TOML
listen = "unix://$work/labd.sock"
state_dir = "$work/state"
store = "file://$work/store"
cache_dir = "$work/cache"
run_as = "labd"
TOML
"$LABSYNC_BIN/labd" --config "$work/labd.toml" > "$work/labd.log" 2>&1 &
labd_pid=$!
for _ in $(seq 100); do [ -S "$work/labd.sock" ] && break; sleep 0.1; done
export LABRUN_LABD="unix://$work/labd.sock"
export LABRUN_TOKEN="$(cat "$work/state/token")"
labrun="$LABSYNC_BIN/labrun"

echo "== labd: $(head -1 "$work/labd.log")"
echo "== nvidia-smi (for comparison)"
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv || true

cat > "$work/hold.py" <<'PY'
import ctypes, sys, time
cuda = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        sys.exit(f"{what} failed: CUDA error {r}")
ok(cuda.cuInit(0), "cuInit")
dev = ctypes.c_int()
ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p()
ok(cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev), "cuCtxCreate")
ptr = ctypes.c_uint64()
ok(cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(1 << 30)), "cuMemAlloc")
print("holding 1 GiB on GPU 0", flush=True)
time.sleep(600)
PY
python3 "$work/hold.py" &
holder_pid=$!
sleep 5
echo "== labrun status (holder pid $holder_pid)"
status="$("$labrun" status)"
echo "$status"
echo "$status" | grep -q "GPU 0 .*GiB" || { echo "gpu-check: FAIL: no real memory reading for GPU 0"; exit 1; }
echo "$status" | grep -q "FOREIGN: .*pid $holder_pid" || { echo "gpu-check: FAIL: the holder is not shown as foreign"; exit 1; }

kill "$holder_pid"; wait "$holder_pid" 2> /dev/null || true; holder_pid=""
sleep 2
echo "== after the holder ended"
"$labrun" status
mkdir -p "$work/code"
cd "$work/code"
out="$("$labrun" -q --gpus 1 -- bash -c 'echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES; nvidia-smi -L || true')"
echo "$out"
echo "$out" | grep -q "CUDA_VISIBLE_DEVICES=0" || { echo "gpu-check: FAIL: the job did not get GPU 0"; exit 1; }
echo "gpu-check: OK"
