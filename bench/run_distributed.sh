#!/usr/bin/env bash
# LoRA fine-tuning of the tiny Gemma 2 model on one process against two MPI ranks: tokens/s and the
# time per step spent in collectives, for
#   1 rank  × 2 threads (no mesh)
#   2 ranks × 1 thread  --mesh 1x2 --layout auto   (model axis 2: KerasHub's layout map, tensor parallel)
#   2 ranks × 1 thread  --mesh 1x2 --layout auto --no-tensor-parallel   (the same, all-gather plan)
#   2 ranks × 1 thread  --mesh 2x1 --layout auto   (batch axis 2 + the layout map's splits over it)
#   2 ranks × 1 thread  --mesh 2x1                 (DataParallel: replicated weights, gradient sums)
# Each configuration runs RUNS times (default 3); the table shows medians. Per run, from finetune's
# final JSON line: tokens/s = steps·batch·seq_len / train_seconds, collective ms/step =
# 1000·collective_seconds / steps (rank 0's wall time inside MPI calls, waiting included).
#
#   bench/run_distributed.sh                   # STEPS=30 BATCH=4 SEQ_LEN=128 RUNS=3
# JSON lines go to $BENCH_OUT (default build/bench/distributed.jsonl). See bench/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j2 --target meshtune >&2
out="${BENCH_OUT:-build/bench/distributed.jsonl}"
model="${MODEL:-/tmp/bench-tiny}"
runs="${RUNS:-3}"
steps="${STEPS:-30}"
batch="${BATCH:-4}"
seq_len="${SEQ_LEN:-128}"
mkdir -p "$(dirname "$out")"
: > "$out"
[ -f "$model/config.json" ] || ./build/meshtune init --config tiny-gemma2 "$model" >&2
work=$(mktemp -d /tmp/meshtune-bench-dist.XXXXXX)
trap 'rm -rf "$work"' EXIT

# The built-in sample has 60 examples: 15 steps of 4 per epoch, so enough epochs for $steps steps.
epochs=$(( (steps * batch + 59) / 60 ))
common=(finetune "$model" --data sample --seq-len "$seq_len" --batch-size "$batch" --steps "$steps"
        --epochs "$epochs" --lora-rank 4 --no-progress --no-shuffle)

BENCH_NAME=run_distributed
. bench/wait_for_quiet.sh

# Busy clock ticks of the whole machine so far, and CPU seconds of this shell's finished children.
# (`times` must run in this shell, not in a $(…) subshell, to see this shell's children.)
machine_ticks() { awk 'NR == 1 { print $2 + $3 + $4 + $7 + $8 + $9 }' /proc/stat; }
children_cpu_s() { awk 'NR == 2 { t = 0; for (i = 1; i <= 2; i++) { split($i, a, "m"); t += a[1] * 60 + a[2] } print t }' "$1"; }

# measure NAME CMD...: runs CMD, takes its last stdout line (finetune's JSON result) and appends
# {"config": NAME, "foreign_cpus": …, ...result} to $out. foreign_cpus: CPUs other processes kept
# busy during the run (machine busy time minus the run's own CPU time, over its wall time).
measure() {
  local name="$1"
  shift
  wait_for_quiet
  local line t0 t1 b0 b1 c0 c1
  times > "$work/times0"
  b0=$(machine_ticks); t0=$(date +%s.%N)
  "$@" --out "$work/$RANDOM" > "$work/stdout" 2> "$work/stderr" || { cat "$work/stderr" >&2; exit 1; }
  b1=$(machine_ticks); t1=$(date +%s.%N)
  times > "$work/times1"
  line=$(tail -n 1 "$work/stdout")
  c0=$(children_cpu_s "$work/times0"); c1=$(children_cpu_s "$work/times1")
  /usr/bin/python3 -c '
import json, sys
r = json.loads(sys.argv[2]); r["config"] = sys.argv[1]
b0, b1, c0, c1, t0, t1, hz = map(float, sys.argv[3:])
r["foreign_cpus"] = round(max(0.0, ((b1 - b0) / hz - (c1 - c0)) / (t1 - t0)), 3)
print(json.dumps(r))' "$name" "$line" "$b0" "$b1" "$c0" "$c1" "$t0" "$t1" "$(getconf CLK_TCK)" | tee -a "$out"
}

mpi=(mpirun --allow-run-as-root --oversubscribe -np 2 ./build/meshtune --threads 1)
for ((r = 0; r < runs; r++)); do
  measure "1 rank x 2 threads" ./build/meshtune --threads 2 "${common[@]}"
  measure "2 ranks x 1 thread, mesh 1x2, layout auto" "${mpi[@]}" "${common[@]}" --mesh 1x2 --layout auto
  measure "2 ranks x 1 thread, mesh 1x2, layout auto, all-gather" "${mpi[@]}" "${common[@]}" --mesh 1x2 --layout auto \
    --no-tensor-parallel
  measure "2 ranks x 1 thread, mesh 2x1, layout auto" "${mpi[@]}" "${common[@]}" --mesh 2x1 --layout auto
  measure "2 ranks x 1 thread, mesh 2x1 (DataParallel)" "${mpi[@]}" "${common[@]}" --mesh 2x1
done

/usr/bin/python3 - "$out" "$batch" "$seq_len" <<'PY'
import json, statistics, sys
batch, seq_len = int(sys.argv[2]), int(sys.argv[3])
by = {}
for line in open(sys.argv[1]):
    if line.strip():
        r = json.loads(line)
        by.setdefault(r["config"], []).append(r)
head = ["configuration", "steps", "tokens/s", "ms/step", "collective ms/step", "collective share", "final loss", "runs",
        "busy CPUs"]
cells = [head]
base = None
for name, rs in by.items():
    med = lambda f: statistics.median(f(r) for r in rs)
    tok = med(lambda r: r["steps"] * batch * seq_len / r["train_seconds"])
    ms = med(lambda r: 1e3 * r["train_seconds"] / r["steps"])
    coll = med(lambda r: 1e3 * r["collective_seconds"] / r["steps"])
    base = base or tok
    cells.append([name, str(rs[0]["steps"]), f"{tok:.0f} ({tok / base:.2f}x)", f"{ms:.1f}", f"{coll:.1f}",
                  f"{coll / ms:.0%}", f"{med(lambda r: r['loss']):.6f}", str(len(rs)),
                  f"{max(r.get('foreign_cpus', 0) for r in rs):.2f}"])
widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
for n, row in enumerate(cells):
    print(" | ".join((c.ljust(w) if i == 0 else c.rjust(w)) for i, (c, w) in enumerate(zip(row, widths))))
    if n == 0:
        print("-+-".join("-" * w for w in widths))
print("medians over runs; (Nx) = tokens/s relative to the first row; collective ms/step = rank 0's time inside MPI "
      "calls (waiting for the other rank included) / steps; final loss = the epoch's mean loss, the same in every "
      "configuration when they train the same model; busy CPUs = the most CPUs other processes kept busy during a run "
      "(whole process lifetime, start-up included; > ~0.2: rerun)")
PY
