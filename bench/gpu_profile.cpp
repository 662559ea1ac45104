#include "gpu_profile.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"

#ifdef MESHTUNE_HAVE_CUDA
#include <cupti.h>

#include "core/shared_library.h"

namespace meshtune::bench {
namespace {

struct Cupti {
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetCallbackName) callback_name = nullptr;
};

const Cupti& cupti() {
  static const Cupti api = [] {
    const std::string soname = MESHTUNE_CUPTI_SONAME;
    void* lib = open_shared_library(soname, MESHTUNE_CUPTI_DIR, "--gpu-profile (CUPTI)");
    auto symbol = [&](const char* name) { return library_symbol(lib, soname, name, "--gpu-profile (CUPTI)"); };
    Cupti c;
    c.enable = reinterpret_cast<decltype(c.enable)>(symbol("cuptiActivityEnable"));
    c.disable = reinterpret_cast<decltype(c.disable)>(symbol("cuptiActivityDisable"));
    c.register_callbacks = reinterpret_cast<decltype(c.register_callbacks)>(symbol("cuptiActivityRegisterCallbacks"));
    c.flush_all = reinterpret_cast<decltype(c.flush_all)>(symbol("cuptiActivityFlushAll"));
    c.next_record = reinterpret_cast<decltype(c.next_record)>(symbol("cuptiActivityGetNextRecord"));
    c.callback_name = reinterpret_cast<decltype(c.callback_name)>(symbol("cuptiGetCallbackName"));
    return c;
  }();
  return api;
}

void check_cupti(CUptiResult result, const char* what) {
  check(result == CUPTI_SUCCESS, "--gpu-profile: ", what, " failed (CUPTI error ", int(result), ")");
}

// What the callbacks collect (CUPTI calls them on its own thread).
struct Recorded {
  std::mutex mutex;
  std::vector<std::pair<uint64_t, uint64_t>> intervals;  // every activity's [start, end), ns
  std::map<std::string, std::pair<int64_t, uint64_t>> by_name;  // name → (count, ns)
  uint64_t kernel_ns = 0, copy_ns = 0;
  int64_t kernels = 0;
  // The host's time inside CUDA's runtime and driver calls (a runtime call's driver calls are
  // inside it, so the two are not added), and per call name.
  uint64_t runtime_ns = 0, driver_ns = 0;
  int64_t runtime_calls = 0, driver_calls = 0;
  std::map<std::string, std::pair<int64_t, uint64_t>> api_by_name;
};
Recorded& recorded() {
  static Recorded r;
  return r;
}

// "void meshtune::cuda::(anonymous namespace)::rmsnorm_kernel(float const*, ...)" → "rmsnorm_kernel":
// no return type, parameters or namespaces of ours; others' (cuBLAS') names cut at 90 characters.
std::string short_name(const char* mangled) {
  int status = 0;
  char* demangled = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
  std::string name = status == 0 && demangled ? demangled : mangled;
  std::free(demangled);
  if (!name.empty() && name.back() == ')') {  // drop the parameter list
    int depth = 0;
    for (size_t i = name.size(); i-- > 0;) {
      depth += name[i] == ')' ? 1 : name[i] == '(' ? -1 : 0;
      if (depth == 0) {
        name.erase(i);
        break;
      }
    }
  }
  if (name.rfind("void ", 0) == 0) name.erase(0, 5);
  for (const std::string ours : {"meshtune::cuda::(anonymous namespace)::", "meshtune::cuda::", "meshtune::"})
    if (name.rfind(ours, 0) == 0) name.erase(0, ours.size());
  return name.size() > 90 ? name.substr(0, 90) + "…" : name;
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *size = size_t(8) << 20;
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, *size));
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
  Recorded& r = recorded();
  const std::lock_guard<std::mutex> lock(r.mutex);
  CUpti_Activity* record = nullptr;
  while (cupti().next_record(buffer, valid, &record) == CUPTI_SUCCESS) {
    uint64_t start = 0, end = 0;
    std::string name;
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      start = k->start, end = k->end, name = short_name(k->name);
      r.kernel_ns += end - start, ++r.kernels;
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      start = m->start, end = m->end;
      name = m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_HTOD   ? "(copy host → GPU)"
             : m->copyKind == CUPTI_ACTIVITY_MEMCPY_KIND_DTOH ? "(copy GPU → host)"
                                                              : "(copy on the GPU)";
      r.copy_ns += end - start;
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      start = m->start, end = m->end, name = "(memset)";
      r.copy_ns += end - start;
    } else if (record->kind == CUPTI_ACTIVITY_KIND_RUNTIME || record->kind == CUPTI_ACTIVITY_KIND_DRIVER) {
      const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(record);
      const bool runtime = record->kind == CUPTI_ACTIVITY_KIND_RUNTIME;
      (runtime ? r.runtime_ns : r.driver_ns) += a->end - a->start;
      ++(runtime ? r.runtime_calls : r.driver_calls);
      const char* api = nullptr;
      cupti().callback_name(runtime ? CUPTI_CB_DOMAIN_RUNTIME_API : CUPTI_CB_DOMAIN_DRIVER_API, a->cbid, &api);
      auto& [count, ns] = r.api_by_name[api ? api : "?"];
      ++count, ns += a->end - a->start;
      continue;
    } else {
      continue;
    }
    r.intervals.emplace_back(start, end);
    auto& [count, ns] = r.by_name[name];
    ++count, ns += end - start;
  }
  std::free(buffer);
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_DRIVER};

}  // namespace

GpuProfile::GpuProfile() {
  const Cupti& api = cupti();
  static const bool registered = [&] {
    check_cupti(api.register_callbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    return true;
  }();
  (void)registered;
  Recorded& r = recorded();
  {
    const std::lock_guard<std::mutex> lock(r.mutex);
    r.intervals.clear(), r.by_name.clear(), r.kernel_ns = r.copy_ns = 0, r.kernels = 0;
    r.runtime_ns = r.driver_ns = 0, r.runtime_calls = r.driver_calls = 0, r.api_by_name.clear();
  }
  for (CUpti_ActivityKind kind : kKinds) check_cupti(api.enable(kind), "cuptiActivityEnable");
}

GpuProfile::~GpuProfile() {
  for (CUpti_ActivityKind kind : kKinds) cupti().disable(kind);
}

nlohmann::ordered_json GpuProfile::stop(int repeats, int top) {
  check_cupti(cupti().flush_all(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  for (CUpti_ActivityKind kind : kKinds) cupti().disable(kind);
  Recorded& r = recorded();
  const std::lock_guard<std::mutex> lock(r.mutex);
  const double per = 1e-6 / std::max(1, repeats);  // ns → ms per repeat
  std::sort(r.intervals.begin(), r.intervals.end());
  uint64_t busy = 0, covered_to = 0;
  for (const auto& [start, end] : r.intervals) {  // the union of the intervals
    if (end <= covered_to) continue;
    busy += end - std::max(start, covered_to);
    covered_to = end;
  }
  const uint64_t span = r.intervals.empty() ? 0 : covered_to - r.intervals.front().first;
  std::vector<std::pair<std::string, std::pair<int64_t, uint64_t>>> rows(r.by_name.begin(), r.by_name.end());
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  nlohmann::ordered_json j;
  j["span_ms"] = double(span) * per;
  j["busy_ms"] = double(busy) * per;
  j["kernel_ms"] = double(r.kernel_ns) * per;
  j["copy_ms"] = double(r.copy_ns) * per;
  j["kernels"] = double(r.kernels) / std::max(1, repeats);
  j["host_in_runtime_ms"] = double(r.runtime_ns) * per;
  j["runtime_calls"] = double(r.runtime_calls) / std::max(1, repeats);
  j["host_in_driver_ms"] = double(r.driver_ns) * per;
  j["driver_calls"] = double(r.driver_calls) / std::max(1, repeats);
  std::vector<std::pair<std::string, std::pair<int64_t, uint64_t>>> apis(r.api_by_name.begin(), r.api_by_name.end());
  std::sort(apis.begin(), apis.end(), [](const auto& a, const auto& b) { return a.second.second > b.second.second; });
  nlohmann::ordered_json api_list = nlohmann::ordered_json::array();
  for (size_t i = 0; i < apis.size() && i < 8; ++i)
    api_list.push_back({{"name", apis[i].first}, {"count", double(apis[i].second.first) / std::max(1, repeats)},
                        {"ms", double(apis[i].second.second) * per}});
  j["host_calls"] = api_list;
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  int64_t rest_count = 0;
  uint64_t rest_ns = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& [name, stats] = rows[i];
    if (int(i) >= top) {
      rest_count += stats.first, rest_ns += stats.second;
      continue;
    }
    list.push_back({{"name", name}, {"count", double(stats.first) / std::max(1, repeats)},
                    {"ms", double(stats.second) * per}});
  }
  if (rest_count > 0)
    list.push_back({{"name", std::to_string(rows.size() - size_t(top)) + " others"},
                    {"count", double(rest_count) / std::max(1, repeats)}, {"ms", double(rest_ns) * per}});
  j["top"] = list;
  return j;
}

}  // namespace meshtune::bench

#else  // built without CUDA

namespace meshtune::bench {
GpuProfile::GpuProfile() { fail("--gpu-profile: this build has no CUDA backend"); }
GpuProfile::~GpuProfile() = default;
nlohmann::ordered_json GpuProfile::stop(int, int) { return {}; }
}  // namespace meshtune::bench

#endif
