#!/usr/bin/env bash
# Builds bench_train, then for each row runs meshtune (bench_train) and the PyTorch reference
# (bench/torch_lora_step.py, Debian's python3-torch) one after the other, each in its own process
# (so peak RSS is per configuration and the two never hold a model at the same time), and prints
# a table with the ratio torch ms/step ÷ meshtune ms/step (> 1: meshtune is faster).
#
#   bench/run_train.sh                        # rows: small, 2b with 2 layers, 2b with 18 layers
#   ROWS="small 2b:2" RUNS=3 bench/run_train.sh --steps 5
#   ROWS=2b:2 BASES="f32 bf16 int8" bench/run_train.sh   # LoRA over each frozen base
#   ROWS=2b:2 BASES=bf16 POLICIES="float32 mixed_bfloat16" bench/run_train.sh
#
# ROWS: shape[:layers] items. BASES: the frozen base weights meshtune trains over (f32, bf16, int8:
# bench_train --weights; default f32), each a row of its own beside the one PyTorch fp32 run.
# POLICIES: Keras dtype policies for meshtune (bench_train --dtype-policy; default float32). RUNS: runs per implementation and row (the table shows the median
# of the runs' median ms/step). BENCH_APPEND=1 keeps the lines of earlier runs in $BENCH_OUT (the
# table then covers them too). Extra arguments go to both programs. A PyTorch run that fails,
# runs out of memory or takes longer than TORCH_TIMEOUT seconds (default 600) is reported in the
# table instead of stopping the script. Before each run the script waits (up to 20 min) while an
# inference benchmark (bench_inference, ./bw) is running, then (up to 5 min) for an idle machine.
# JSON lines go to $BENCH_OUT (default
# build/bench/train.jsonl). See bench/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j2 --target bench_train >&2
out="${BENCH_OUT:-build/bench/train.jsonl}"
rows="${ROWS:-small 2b:2 2b:18}"
runs="${RUNS:-1}"
bases="${BASES:-f32}"
policies="${POLICIES:-float32}"
torch_timeout="${TORCH_TIMEOUT:-600}"
python=/usr/bin/python3  # Debian's interpreter, which has python3-torch
mkdir -p "$(dirname "$out")"
[ "${BENCH_APPEND:-0}" = 1 ] || : > "$out"  # BENCH_APPEND=1: add to earlier runs' lines

BENCH_NAME=run_train
. bench/wait_for_quiet.sh

# run IMPL TIMEOUT CMD...: appends the program's JSON line to $out, or a line saying why there is none.
run() {
  local impl="$1" limit="$2" shape="$3" layers="$4"
  shift 4
  wait_for_quiet
  local line rc=0
  line=$(timeout "$limit" "$@" | tail -n 1) || rc=$?
  if [ "$rc" -eq 0 ] && [ -n "$line" ]; then
    echo "$line" | tee -a "$out"
    return
  fi
  local why="failed (exit $rc)"
  [ "$rc" -eq 124 ] && why="took longer than ${limit} s"
  [ "$rc" -eq 137 ] && why="killed (out of memory?)"
  echo "{\"impl\": \"$impl\", \"shape\": \"$shape\", \"layers\": $layers, \"error\": \"$why\"}" | tee -a "$out"
}

for row in $rows; do
  shape="${row%%:*}"
  layers=0
  [ "$row" != "$shape" ] && layers="${row#*:}"
  shown_layers=$layers
  [ "$layers" -eq 0 ] && { [ "$shape" = small ] && shown_layers=2 || shown_layers=18; }
  for ((r = 0; r < runs; r++)); do
    for base in $bases; do
      for policy in $policies; do
        run meshtune 3600 "$shape" "$shown_layers" ./build/bench/bench_train --shape "$shape" --layers "$layers" \
          --weights "$base" --dtype-policy "$policy" "$@"
      done
    done
    run torch "$torch_timeout" "$shape" "$shown_layers" \
      "$python" bench/torch_lora_step.py --shape "$shape" --layers "$layers" "$@"
  done
done

"$python" - "$out" <<'PY'
import json, statistics, sys
rows, torch = {}, {}  # meshtune's by (shape, layers, base weights, policy); PyTorch's (fp32) by (shape, layers)
for line in open(sys.argv[1]):
    if line.strip():
        r = json.loads(line)
        if r["impl"] == "torch":
            torch.setdefault((r["shape"], r["layers"]), []).append(r)
        else:
            rows.setdefault((r["shape"], r["layers"], r.get("weights", "f32"), r.get("dtype_policy", "float32")),
                            []).append(r)
for shape, layers in torch:
    if not any(k[:2] == (shape, layers) for k in rows):
        rows[(shape, layers, "f32", "float32")] = []

def summary(runs):
    ok = [r for r in (runs or []) if "error" not in r]
    if not ok:
        return None, (runs[0]["error"] if runs else "not run")
    # Runs during which other processes kept more than a quarter CPU busy are left out when an
    # undisturbed run exists (on 2 cores a busy neighbour slows GEMMs and OpenMP barriers a lot).
    ok = [r for r in ok if r["foreign_cpus"] <= 0.25] or ok
    med = lambda k: statistics.median(r[k] for r in ok)
    return {"ms": med("ms_per_step"), "tok": med("tokens_per_s"), "gflops": med("gflops"),
            "rss": max(r["peak_rss_gib"] for r in ok), "busy": max(r["foreign_cpus"] for r in ok),
            "gflop": ok[0]["gflop_per_step"], "n": len(ok)}, None

head = ["row", "GFLOP/step", "meshtune ms/step", "tok/s", "GFLOP/s", "RSS GiB",
        "torch ms/step", "tok/s", "GFLOP/s", "RSS GiB", "torch/meshtune", "runs", "busy CPUs"]
cells = [head]
for (shape, layers, base, policy), mine in rows.items():
    impls = {"meshtune": mine, "torch": torch.get((shape, layers), [])}
    m, m_err = summary(impls["meshtune"])
    t, t_err = summary(impls["torch"])
    cell = [f"{shape} L{layers} {base} {policy}", f"{(m or t or {}).get('gflop', 0):.1f}"]
    for s, err in ((m, m_err), (t, t_err)):
        cell += [f"{s['ms']:.1f}", f"{s['tok']:.0f}", f"{s['gflops']:.1f}", f"{s['rss']:.2f}"] if s else [err, "-", "-", "-"]
    cell.append(f"{t['ms'] / m['ms']:.2f}" if m and t else "-")
    cell.append(f"{(m or {}).get('n', 0)}/{(t or {}).get('n', 0)} of {len(impls.get('meshtune', []))}/{len(impls.get('torch', []))}")
    cell.append(f"{max((m or {}).get('busy', 0), (t or {}).get('busy', 0)):.2f}")
    cells.append(cell)
widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
for n, row in enumerate(cells):
    print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
    if n == 0:
        print("-+-".join("-" * w for w in widths))
print("medians over runs; torch/meshtune = torch ms/step ÷ meshtune ms/step (> 1: meshtune faster); runs = runs "
      "used (meshtune/torch) of those made; runs whose timed steps shared the CPUs with other processes (> 0.25 "
      "busy CPUs) are left out when an undisturbed one exists; busy CPUs = the most among the runs used")
PY
