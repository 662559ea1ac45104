// Which implementation each kind of matrix product takes on this machine, chosen by timing the
// candidates rather than by rules written on other machines: the same oneDNN matmul ran at 150
// GFLOP/s on one AVX512_BF16 CPU and at 600 on the next, against ~160 for OpenBLAS on both.
//
// For each kind (kernel_path.h's Product) both routes run the same product at a Gemma-like shape
// (128 rows × 4096 × 2048, about 2 GFLOP) after a warm-up, three times each, interleaved; the one
// with the better median wins (our own route on a tie within 2 %). The shape matters: at 2048 × 2048
// the weights stay in the L3 cache and oneDNN on widened bf16 weights looked 1.9× faster than
// sgemm's tiles, while at the model's 16384 × 2048 it is 0.85× (4096 × 2048 ranks them as the model's
// shapes do, bench_gemm's route rows). All kinds take about 1.3 s on 2 cores, once: the result is cached (core/machine_cache.h) under the CPU model and features, the
// OpenBLAS and oneDNN builds and the thread count (a cache that cannot be read or written is
// ignored: the run measures and goes on); processes that would measure at once (MPI ranks) take
// a lock — one measures, the others read its result — so a job's processes take the same routes.
// MESHTUNE_RECALIBRATE=1 or `meshtune info --system
// --recalibrate` measures again.
#pragma once
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend/cpu/kernel_path.h"
#include "core/weight_matrix.h"

namespace meshtune {

struct RouteRates {
  double own = 0, onednn = 0;  // GFLOP/s (int8: GOP/s); 0 = not a candidate here
};

// One product shape's own measurement (see route_at_shape).
struct ShapeRoute {
  RouteRates rates;
  bool onednn = false;
};

struct MeasuredRoutes {
  ProductRoutes onednn{};  // the faster route per kind
  std::array<RouteRates, kProductKinds> rates{};
  std::map<std::string, ShapeRoute> shapes;  // "KIND at M × rows × cols": large products, by shape
  int threads = 0;
  std::string source;  // where the numbers came from: measured now / read from the cache, and the file
};

// Random operands for one product of every kind, y[M, rows] = x[M, cols]·Wᵀ (and its gradients),
// to time the routes: here at the calibration shape, in bench_gemm at the model's.
class ProductProbe {
 public:
  ProductProbe(int64_t M, int64_t rows, int64_t cols);
  void run(Product p, const KernelPath& path);  // one product of kind p, on the route `path` gives it
  double ops() const { return 2.0 * double(M_) * double(rows_) * double(cols_); }

 private:
  int64_t M_, rows_, cols_;
  WeightMatrix W_, W_bf16_, W_i8_;
  std::vector<float> x_, dy_, y_, dx_, dW_;
};

// Whether oneDNN can take products of `kind` on path `isa`: a build with oneDNN, bf16 dot products
// for bf16 inputs, exact int32 sums for int8 (checked at the first call that asks about int8).
bool onednn_can_take(CpuPath isa, Product kind);

// The routes for the current OpenMP thread count: from the cache, else measured (once per process
// and thread count).
const MeasuredRoutes& measured_routes();
// Products of at least this many FLOPs get their route measured at their own shape: the faster
// route differs with the shape (at Gemma 7B's 256 × 24576 × 3072 two kinds rank the other way than
// at the calibration shape). Smaller ones, and all of a test's tiny models, take the kind's route.
inline constexpr double kShapeRouteFlops = 1e9;
// The route (true: oneDNN) of one product of `kind` with M rows and W [rows, cols], at least
// kShapeRouteFlops: measured the first time this process meets the shape — M rounded up to a power
// of two — by `time_route`, which runs the product on the given route into scratch memory and
// returns its seconds (once per route after a warm-up each — four products, a few seconds per shape
// of a 7B model —; our own route on a tie within 2 %); then kept, and saved with the kinds' routes
// in the cache.
bool route_at_shape(Product kind, int64_t M, int64_t rows, int64_t cols, const std::function<double(bool onednn)>& time_route);

// Makes this process measure the routes again, as MESHTUNE_RECALIBRATE does (`info --recalibrate`).
void recalibrate_routes();

// Lines for `meshtune info --system`: each kind's rates and the route `path` takes, and the shapes
// measured so far (in this process or the cache).
std::vector<std::string> route_report(const KernelPath& path, const MeasuredRoutes& measured);

}  // namespace meshtune
