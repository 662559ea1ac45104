#!/usr/bin/env bash
# The tutorial's fine-tune from a Gemma-7B-shaped bf16 Keras preset on disk, two builds side by side:
# load s (the engine's "loaded … in X s"), ms per step (--log-jsonl), peak RSS and wall time
# (/usr/bin/time), the page cache dropped before each run (needs root). Results in DIR/results.txt.
#   bench/run7b.sh DIR   DIR holding meshtune-before and meshtune-after (the two binaries) and
#                        gemma7b/ (e.g. `meshtune init --config gemma_7b_en --dtype bfloat16 DIR/gemma7b`,
#                        17 GB, ~4 min); about 25 minutes on 2 cores.
set -uo pipefail
cd "$1"
# Some machines' environments set OPENBLAS_CORETYPE; a user's shell has no such variable.
unset OPENBLAS_CORETYPE OPENBLAS_L2_SIZE
python3 - <<'PY'  # 8 rows of 129 token ids below 512: ids.npy
import random, struct
random.seed(0)
header = "{'descr': '<i4', 'fortran_order': False, 'shape': (8, 129), }"
header += " " * (64 - (10 + len(header) + 1) % 64) + "\n"
with open("ids.npy", "wb") as f:
    f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode())
    f.write(struct.pack("<1032i", *[random.randrange(3, 512) for _ in range(1032)]))
PY
./meshtune-after info --system > after-system.txt 2>&1  # OpenBLAS' family and the routes measured first
for policy in mixed_bfloat16 int8 float32; do
  for bin in before after; do
    extra="--dtype-policy $policy"
    [ "$policy" = int8 ] && extra="--dtype-policy float32 --quantize int8"
    sync; echo 1 > /proc/sys/vm/drop_caches
    tag=$policy-$bin
    rm -rf "run-$tag"
    /usr/bin/time -f "wall %e s user %U sys %S maxrss %M kB" "./meshtune-$bin" finetune gemma7b --data npy:ids.npy \
      --steps 3 --batch-size 2 --seq-len 128 --lora-rank 4 $extra --no-progress --log-jsonl "log-$tag.jsonl" \
      --out "run-$tag" > "out-$tag.txt" 2> "err-$tag.txt"
    echo "$tag: $(grep -o 'in [0-9.]* s' "err-$tag.txt" | head -1) | $(tail -1 "err-$tag.txt") | steps ms:" \
         "$(grep -o '"ms_per_step":[0-9.]*' "log-$tag.jsonl" | cut -d: -f2 | tr '\n' ' ')| losses:" \
         "$(grep -o '"loss":[0-9.]*' "log-$tag.jsonl" | cut -d: -f2 | tr '\n' ' ')" >> results.txt
    rm -rf "run-$tag"
  done
done
