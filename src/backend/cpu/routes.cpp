#include "backend/cpu/routes.h"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <random>

#include "core/error.h"
#include "core/json.h"
#include "core/machine_cache.h"
#include "backend/cpu/int8.h"
#include "backend/cpu/isa/onednn.h"
#include "backend/cpu/linear.h"

namespace meshtune {

namespace {

bool recalibrate = false;

// What the measurement depends on; a cache file measured under another key is not used.
std::string cache_key(int threads) {
  return "routes v3; cpu " + cpu_identity() + "; OpenBLAS " +
         openblas_get_config() + " core " + openblas_get_corename() + "; oneDNN " +
         (cpu::onednn_available() ? cpu::onednn_version() : "none") + "; threads " + std::to_string(threads);
}

std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.f, 1.f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = normal(rng);
  return v;
}

// Times `own` and `onednn` (each one product), interleaved after a warm-up each: median seconds.
template <typename F, typename G>
std::pair<double, double> time_both(F&& own, G&& onednn, bool with_onednn) {
  using Clock = std::chrono::steady_clock;
  auto seconds = [](auto&& f) {
    const auto t0 = Clock::now();
    f();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  own();
  if (with_onednn) onednn();
  std::vector<double> a, b;
  for (int i = 0; i < 3; ++i) {
    a.push_back(seconds(own));
    if (with_onednn) b.push_back(seconds(onednn));
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  return {median(a), median(b)};
}

MeasuredRoutes measure(int threads) {
  const CpuPath isa = supported_cpu_paths().back();
  const KernelPath own = make_kernel_path(isa), onednn = make_kernel_path(isa, every_product_on_onednn());
  ProductProbe probe(128, 4096, 2048);
  MeasuredRoutes m;
  m.threads = threads;
  for (int p = 0; p < kProductKinds; ++p) {
    const Product kind = Product(p);
    const bool candidate = onednn_can_take(isa, kind);
    const auto [own_s, onednn_s] = time_both([&] { probe.run(kind, own); }, [&] { probe.run(kind, onednn); }, candidate);
    m.rates[size_t(p)] = {probe.ops() / own_s / 1e9, candidate ? probe.ops() / onednn_s / 1e9 : 0.0};
    m.onednn[size_t(p)] = candidate && m.rates[size_t(p)].onednn > 1.02 * m.rates[size_t(p)].own;
  }
  return m;
}

// One measured entry of the cache: {own_gflops, onednn_gflops, route}. oneDNN's rate is 0 where it
// was not a candidate (only for kinds).
json route_entry(const RouteRates& rates, bool onednn) {
  return {{"own_gflops", rates.own}, {"onednn_gflops", rates.onednn}, {"route", onednn ? "onednn" : "own"}};
}

// An entry read back: nothing when it is not sane (then everything is measured again).
std::optional<ShapeRoute> read_route_entry(const json& e) {
  const double own = e.at("own_gflops").get<double>(), onednn = e.at("onednn_gflops").get<double>();
  const std::string route = e.at("route").get<std::string>();
  if (!(std::isfinite(own) && own > 0 && std::isfinite(onednn) && onednn >= 0) || (route != "own" && route != "onednn"))
    return std::nullopt;
  return ShapeRoute{{own, onednn}, route == "onednn"};
}

// The cached measurement for `key`, if the cache holds a complete, sane one.
std::optional<MeasuredRoutes> read_cache(const std::string& key, int threads) {
  const std::optional<json> j = read_machine_cache("routes", key);
  if (!j) return std::nullopt;
  try {
    MeasuredRoutes m;
    m.threads = threads;
    for (int p = 0; p < kProductKinds; ++p) {
      const std::optional<ShapeRoute> e = read_route_entry(j->at("products").at(product_name(Product(p))));
      if (!e) return std::nullopt;
      m.rates[size_t(p)] = e->rates;
      m.onednn[size_t(p)] = e->onednn;
    }
    if (j->contains("shapes"))
      for (const auto& [name, entry] : j->at("shapes").items()) {
        const std::optional<ShapeRoute> e = read_route_entry(entry);
        if (!e || e->rates.onednn == 0) return std::nullopt;  // a shape is measured on both routes
        m.shapes[name] = *e;
      }
    m.source = "measured " + j->value("measured", std::string("?")) + ", cached in " + machine_cache_path("routes", key);
    return m;
  } catch (const std::exception&) {
    return std::nullopt;  // from another version: measured again
  }
}

std::string write_cache(const std::string& key, const MeasuredRoutes& m) {
  json j;
  for (int p = 0; p < kProductKinds; ++p)
    j["products"][product_name(Product(p))] = route_entry(m.rates[size_t(p)], m.onednn[size_t(p)]);
  for (const auto& [name, shape] : m.shapes) j["shapes"][name] = route_entry(shape.rates, shape.onednn);
  return write_machine_cache("routes", key, j);
}

// "  NAME: ROUTE — measured OWN R, oneDNN R" for `info --system`.
std::string route_line(const std::string& name, bool int8, bool onednn, const RouteRates& r) {
  const std::string own = int8 ? "meshtune" : "OpenBLAS sgemm", unit = int8 ? " GOP/s" : " GFLOP/s";
  auto rate = [&](double v) { return std::to_string(int(std::lround(v))) + unit; };
  return "  " + name + ": " + (onednn ? "oneDNN" : own) + " — measured " + own + " " + rate(r.own) +
         (r.onednn > 0 ? ", oneDNN " + rate(r.onednn) : ", oneDNN not a candidate here");
}

// Function-local: a CpuBackend made by a static initialiser elsewhere may come first.
std::mutex& routes_mutex() {
  static std::mutex mutex;
  return mutex;
}

// The routes for `threads`; routes_mutex() held.
MeasuredRoutes& routes_for(int threads) {
  static std::map<int, MeasuredRoutes> routes_by_threads;
  if (auto it = routes_by_threads.find(threads); it != routes_by_threads.end()) return it->second;
  const bool again = recalibrate || recalibration_asked();
  const std::string key = cache_key(threads);
  std::optional<MeasuredRoutes> cached = again ? std::nullopt : read_cache(key, threads);
  if (!cached) {
    const MachineCacheLock other_processes("routes");  // MPI ranks: one measures, the others read its result
    if (!again) cached = read_cache(key, threads);
    if (!cached) {
      cached = measure(threads);
      cached->source = "measured now, " + write_cache(key, *cached);
    }
  }
  return routes_by_threads.emplace(threads, std::move(*cached)).first->second;
}

}  // namespace

ProductProbe::ProductProbe(int64_t M, int64_t rows, int64_t cols)
    : M_(M),
      rows_(rows),
      cols_(cols),
      W_(WeightMatrix::from_f32(rows, cols, random_values(rows * cols, 1))),
      W_bf16_(to_bf16_matrix(W_)),
      W_i8_(quantize_matrix_int8(W_)),
      x_(random_values(M * cols, 2)),
      dy_(random_values(M * rows, 3)),
      y_(static_cast<size_t>(M * rows)),
      dx_(static_cast<size_t>(M * cols)),
      dW_(static_cast<size_t>(rows * cols)) {}

void ProductProbe::run(Product p, const KernelPath& k) {
  switch (p) {
    case Product::F32Linear: return linear(k, x_.data(), M_, W_, y_.data());
    case Product::F32InputGradient: return linear_backward_input(k, dy_.data(), M_, W_, dx_.data());
    case Product::F32WeightGradient: return linear_backward_weight(k, dy_.data(), x_.data(), M_, rows_, cols_, dW_.data());
    case Product::WidenedLinear: return linear(k, x_.data(), M_, W_bf16_, y_.data());
    case Product::WidenedInputGradient: return linear_backward_input(k, dy_.data(), M_, W_bf16_, dx_.data());
    case Product::Bf16Linear: return linear(k, x_.data(), M_, W_bf16_, y_.data(), MatmulPrecision::BF16);
    case Product::Bf16InputGradient:
      return linear_backward_input(k, dy_.data(), M_, W_bf16_, dx_.data(), false, MatmulPrecision::BF16);
    case Product::Int8Linear: return linear_int8(k, x_.data(), M_, W_i8_, y_.data());
  }
}

void recalibrate_routes() { recalibrate = true; }

const MeasuredRoutes& measured_routes() {
  std::lock_guard lock(routes_mutex());
  return routes_for(omp_get_max_threads());
}

bool route_at_shape(Product kind, int64_t M, int64_t rows, int64_t cols, const std::function<double(bool onednn)>& time_route) {
  std::lock_guard lock(routes_mutex());
  const int threads = omp_get_max_threads();
  MeasuredRoutes& routes = routes_for(threads);
  int64_t bucket = 1;
  while (bucket < M) bucket *= 2;
  const std::string name = std::string(product_name(kind)) + " at " + std::to_string(bucket) + " × " +
                           std::to_string(rows) + " × " + std::to_string(cols);
  if (auto it = routes.shapes.find(name); it != routes.shapes.end()) return it->second.onednn;
  // Another process (an MPI rank beside this one) may have measured the shape meanwhile: its
  // result is taken, and kept when this one saves.
  const MachineCacheLock other_processes("routes");
  if (const std::optional<MeasuredRoutes> cached = read_cache(cache_key(threads), threads))
    for (const auto& [other, shape] : cached->shapes) routes.shapes.emplace(other, shape);
  if (auto it = routes.shapes.find(name); it != routes.shapes.end()) return it->second.onednn;
  time_route(false);  // warm-ups: oneDNN compiles its kernel for the shape, pages are touched
  time_route(true);
  const double own = time_route(false), onednn = time_route(true);
  const double ops = 2.0 * double(M) * double(rows) * double(cols);
  ShapeRoute shape{{ops / own / 1e9, ops / onednn / 1e9}, onednn * 1.02 < own};
  routes.shapes[name] = shape;
  write_cache(cache_key(threads), routes);  // best effort: a cache that cannot be written is ignored
  return shape.onednn;
}

bool onednn_can_take(CpuPath isa, Product kind) {
  return make_kernel_path(isa, every_product_on_onednn()).uses_onednn(kind) &&
         (kind != Product::Int8Linear || cpu::onednn_int8_exact());
}

std::vector<std::string> route_report(const KernelPath& path, const MeasuredRoutes& measured) {
  std::vector<std::string> lines{"matrix products of more than 4 rows (" + std::to_string(measured.threads) +
                                 " threads, 128 × 4096 × 2048; " + measured.source + "):"};
  for (int p = 0; p < kProductKinds; ++p) {
    const Product kind = Product(p);
    std::string line = route_line(product_name(kind), kind == Product::Int8Linear, path.uses_onednn(kind),
                                  measured.rates[size_t(p)]);
    if (path.uses_onednn(kind) != measured.onednn[size_t(p)]) line += " (forced)";
    lines.push_back(line);
  }
  if (!measured.shapes.empty()) lines.push_back("measured at their own shapes (products of 1 GFLOP or more):");
  for (const auto& [name, shape] : measured.shapes)
    lines.push_back(route_line(name, name.rfind("int8", 0) == 0, shape.onednn, shape.rates));
  return lines;
}

}  // namespace meshtune
