#!/usr/bin/env bash
# Builds bench_inference and runs it for fp32, bf16 and int8 weights (int8: the bf16 checkpoint
# quantized at load, Keras' formula) and for bf16 weights under the bfloat16 dtype policy (bf16
# matmul inputs), each in its own process (so peak
# RSS is per configuration), then prints a table. Extra arguments go to every run, e.g.
#   bench/run_inference.sh --layers 4 --repeat 5
# The JSON lines are also kept in $BENCH_OUT (default build/bench/inference.jsonl).
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build build -j2 --target bench_inference >&2
out="${BENCH_OUT:-build/bench/inference.jsonl}"
: > "$out"
for dtype in f32 bf16 int8; do
  ./build/bench/bench_inference --dtype "$dtype" "$@" | tee -a "$out"
done
./build/bench/bench_inference --dtype bf16 --dtype-policy bfloat16 "$@" | tee -a "$out"
python3 - "$out" <<'PY'
# One column per configuration, one row per number.
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
rows = [("layers", lambda r: f"{r['layers']}"),
        ("load s (inspect + load_model)", lambda r: f"{r['load_s']:.3f}"),
        ("first prefill s (page faults)", lambda r: f"{r['first_prefill_s']:.2f}"),
        ("prefill tok/s", lambda r: f"{r['prefill_tok_s']:.1f}"),
        ("prefill GFLOP/s", lambda r: f"{r['prefill_gflops']:.1f}"),
        ("prefill / sgemm", lambda r: f"{r['prefill_vs_sgemm']:.2f}"),
        ("decode tok/s", lambda r: f"{r['decode_tok_s']:.2f}"),
        ("weight GB per token", lambda r: f"{r['weight_bytes_per_token'] / 1e9:.2f}"),
        ("read GB/s during runs", lambda r: f"{r['read_gbps_during']:.1f}"),
        ("bandwidth bound tok/s", lambda r: f"{r['bound_tok_s']:.2f}"),
        ("bound ratio (1.0 = at bound)", lambda r: f"{r['bound_ratio']:.2f}"),
        ("peak RSS GiB", lambda r: f"{r['peak_rss_gib']:.2f}"),
        ("sgemm 2048^3 GFLOP/s", lambda r: f"{r['sgemm_gflops']:.1f}"),
        ("sgemm 128x16384x2048 GFLOP/s", lambda r: f"{r['sgemm_prefill_shape_gflops']:.1f}"),
        ("copy GB/s (1 GiB memcpy)", lambda r: f"{r['copy_gbps']:.1f}"),
        ("read GB/s (1 GiB sum)", lambda r: f"{r['read_gbps']:.1f}"),
        ("read GB/s, 1 thread", lambda r: f"{r['read_gbps_1thread']:.1f}"),
        ("foreign CPUs (>0.1: rerun)", lambda r: f"{r['foreign_cpus']:.2f}")]
header = ["", *(r["dtype"] + ("" if r.get("dtype_policy", "float32") == "float32" else " " + r["dtype_policy"])
                for r in runs)]
table = [header] + [[name, *(fmt(r) for r in runs)] for name, fmt in rows]
widths = [max(len(row[i]) for row in table) for i in range(len(header))]
for n, row in enumerate(table):
    print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
PY
