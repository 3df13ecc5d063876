#!/usr/bin/env bash
# The README's main job on a fresh machine: build labsync, make a small sample
# dataset, push it to the default store (~/.local/share/labsync/store), pull it
# back and check the copy is identical.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo build --release --locked --bin labsync
labsync="$PWD/target/release/labsync"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
sample="$work/sample-sr"
mkdir -p "$sample/train" "$sample/valid"
for i in $(seq -w 1 8); do
  head -c $((2000000 + 10#$i * 37000)) /dev/urandom > "$sample/train/08${i}.png"
done
for i in 1 2; do head -c 1500000 /dev/urandom > "$sample/valid/09${i}0.png"; done
printf 'import os\nprint("data at", os.environ.get("LABRUN_DATA"))\n' > "$sample/train.py"

"$labsync" push "$sample" --name sample-sr
"$labsync" pull sample-sr "$work/pulled"
diff -r "$sample" "$work/pulled" && echo "quickstart: pulled copy is identical"
"$labsync" ls
