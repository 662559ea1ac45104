#!/usr/bin/env bash
# Builds bench_inference and runs it for fp32 then bf16 weights, each in its own process (so peak
# RSS is per configuration), then prints a table. Extra arguments go to both runs, e.g.
#   bench/run_inference.sh --layers 4 --repeat 5
# The JSON lines are also kept in $BENCH_OUT (default build/bench/inference.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j2 --target bench_inference >&2
out="${BENCH_OUT:-build/bench/inference.jsonl}"
: > "$out"
for dtype in f32 bf16; do
  ./build/bench/bench_inference --dtype "$dtype" "$@" | tee -a "$out"
done
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
cols = [("dtype", "dtype", "{}"), ("layers", "layers", "{}"), ("load s", "load_s", "{:.3f}"),
        ("1st prefill s", "first_prefill_s", "{:.2f}"), ("prefill tok/s", "prefill_tok_s", "{:.1f}"),
        ("prefill GFLOP/s", "prefill_gflops", "{:.1f}"), ("vs sgemm", "prefill_vs_sgemm", "{:.2f}"),
        ("decode tok/s", "decode_tok_s", "{:.2f}"), ("bound tok/s", "bound_tok_s", "{:.2f}"),
        ("ratio", "bound_ratio", "{:.2f}"), ("GB/token", "weight_bytes_per_token", "{:.2e}"),
        ("peak RSS GiB", "peak_rss_gib", "{:.2f}"), ("sgemm GFLOP/s", "sgemm_gflops", "{:.1f}"),
        ("copy GB/s", "copy_gbps", "{:.1f}"), ("read GB/s", "read_gbps", "{:.1f}")]
cells = [[h for h, _, _ in cols]] + [[f.format(r[k]) for _, k, f in cols] for r in rows]
for row in cells: row[10] = row[10] if row is cells[0] else "{:.2f}".format(float(row[10]) / 1e9)
widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
for n, row in enumerate(cells):
    print(" | ".join(c.rjust(w) for c, w in zip(row, widths)))
    if n == 0: print("-+-".join("-" * w for w in widths))
PY
