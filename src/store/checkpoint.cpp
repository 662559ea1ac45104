#include "store/checkpoint.h"

#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"
#include "io/safetensors.h"

namespace meshtune {

namespace fs = std::filesystem;
using json = nlohmann::json;

static std::string exact(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

static void need_host(const Span<float>& values, size_t n, const std::string& what) {
  check(values.device == Device::Host && values.data != nullptr && values.size >= n, "checkpoint: ", what,
        " is not ", n, " values in host memory");
}

static HostTensor view_of(const Span<float>& values, size_t n, const std::string& what) {
  need_host(values, n, what);
  HostTensor t;
  t.dtype = DType::F32;
  t.shape = {int64_t(n)};
  t.data = reinterpret_cast<const std::byte*>(values.data);
  return t;
}

// This process' file of the checkpoint at `step`: `path` itself on one process.
static std::string rank_file(const std::string& path, int64_t step, DeviceMesh* mesh, int rank) {
  if (!mesh || mesh->size() == 1) return path;
  return path + ".step" + std::to_string(step) + ".rank" + std::to_string(rank);
}

void write_checkpoint(const std::string& path, const CheckpointState& state, const std::vector<CheckpointTensor>& tensors,
                      DeviceMesh* mesh) {
  std::vector<std::pair<std::string, HostTensor>> named;
  for (const CheckpointTensor& t : tensors) {
    named.emplace_back("param/" + t.path, view_of(t.value, t.size, t.path));
    named.emplace_back("momentum/" + t.path, view_of(t.momentum, t.size, "the momentum of " + t.path));
    named.emplace_back("velocity/" + t.path, view_of(t.velocity, t.size, "the velocity of " + t.path));
  }
  std::map<std::string, std::string> meta = {
      {"format", "meshtune-checkpoint-1"},
      {"mode", state.mode},
      {"step", std::to_string(state.step)},
      {"iterations", std::to_string(state.iterations)},
      {"epoch_loss_sum", exact(state.epoch_loss_sum)},
      {"epoch_examples", exact(state.epoch_examples)},
      {"epoch_correct", exact(state.epoch_correct)},
      {"epoch_weight", exact(state.epoch_weight)},
      {"lora_rank", std::to_string(state.lora_rank)},
      {"lora_alpha", exact(state.lora_alpha)},
  };
  if (mesh) {  // where each block lies in its whole variable, so `export` can reassemble them
    json placement = json::object();
    for (const CheckpointTensor& t : tensors)
      placement[t.path] = {{"full", t.placement.full}, {"local", t.placement.local}, {"offset", t.placement.offset}};
    meta["placement"] = placement.dump();
  }
  const int rank = mesh ? mesh->comm().rank() : 0;
  const std::string mine = rank_file(path, state.step, mesh, rank);
  write_safetensors(mine, named, meta);
  if (!mesh || mesh->size() == 1) return;
  // Sharded: every rank has written its file; rank 0 then switches the manifest to this step
  // (atomically), and each rank removes its file of the previous checkpoint.
  mesh->comm().barrier();
  if (rank == 0) {
    json manifest = {{"format", "meshtune-sharded-checkpoint-1"}, {"step", state.step}, {"mesh", mesh->shape()},
                     {"axes", mesh->axis_names()}, {"files", json::array()}};
    for (int r = 0; r < mesh->size(); ++r)
      manifest["files"].push_back(fs::path(rank_file(path, state.step, mesh, r)).filename().string());
    write_file_atomic(path, manifest.dump(2));
  }
  mesh->comm().barrier();
  const fs::path dir = fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
  const std::string base = fs::path(path).filename().string(), suffix = ".rank" + std::to_string(rank);
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(base + ".step", 0) == 0 && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 && entry.path().string() != mine)
      fs::remove(entry.path());
  }
}

// A sharded checkpoint's manifest (rank 0 writes it last): the mesh and every rank's file, each a
// plain name inside the run directory.
struct CheckpointManifest {
  std::vector<int64_t> mesh;
  std::vector<std::string> files;  // full paths, one per rank
};

// Whether `path` is a manifest (JSON) rather than a safetensors file, from its first byte.
static bool is_manifest(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  check(bool(in), path, ": cannot open checkpoint: ", std::strerror(errno));
  char first = 0;
  return in.get(first) && first == '{';
}

static CheckpointManifest read_manifest(const std::string& path) {
  const json doc = read_json_file(path);
  const JsonValue root(doc, path);
  check(root.is_object() && root.string_or("format", "") == "meshtune-sharded-checkpoint-1", path,
        ": not a meshtune sharded-checkpoint manifest");
  CheckpointManifest m;
  const JsonValue mesh = root["mesh"];
  for (const JsonValue& d : mesh.elements()) m.mesh.push_back(d.integer(1, 1 << 20));
  int64_t processes = 1;
  for (int64_t d : m.mesh) check(!__builtin_mul_overflow(processes, d, &processes) && processes <= (1 << 20), mesh.where(), ": too many processes");
  const JsonValue files = root["files"];
  check(int64_t(files.size()) == processes, files.where(), ": lists ", files.size(), " files for a mesh of ", processes,
        " processes");
  const std::string dir = fs::path(path).parent_path().string();
  for (const JsonValue& f : files.elements()) m.files.push_back(plain_file_in(dir, f.string(), f.where()));
  return m;
}

// The files of a checkpoint: the file itself, or every rank's file named by a sharded manifest.
static std::vector<std::string> checkpoint_files(const std::string& manifest_or_file) {
  if (!is_manifest(manifest_or_file)) return {manifest_or_file};
  return read_manifest(manifest_or_file).files;
}

// The checkpoint metadata of one file: strings, with the numbers checked.
struct CheckpointMetadata {
  std::string file;
  std::map<std::string, std::string> values;

  explicit CheckpointMetadata(const std::string& path) : file(path) {
    std::error_code ec;
    check(fs::is_regular_file(path, ec), path, ": checkpoint file is missing");
    values = read_safetensors_metadata(path);
    check(text("format") == "meshtune-checkpoint-1", path, ": not a meshtune checkpoint");
  }
  std::string text(const std::string& key) const {
    auto it = values.find(key);
    return it == values.end() ? std::string() : it->second;
  }
  int64_t integer(const std::string& key, int64_t lo, int64_t hi) const {
    const std::string t = text(key);
    int64_t v = 0;
    const auto [end, err] = std::from_chars(t.data(), t.data() + t.size(), v);
    check(!t.empty() && err == std::errc() && end == t.data() + t.size() && v >= lo && v <= hi, file, ": metadata ",
          key, " must be an integer in [", lo, ", ", hi, "], got \"", brief(t), "\"");
    return v;
  }
  double number(const std::string& key) const {
    const std::string t = text(key);
    char* end = nullptr;
    const double v = t.empty() ? 0 : std::strtod(t.c_str(), &end);
    check(!t.empty() && end == t.c_str() + t.size() && std::isfinite(v), file, ": metadata ", key,
          " must be a number, got \"", brief(t), "\"");
    return v;
  }
};

// Where a file's block of `path` lies in the whole variable (as save_checkpoint records it),
// checked: every extent positive, the block inside the variable.
static ShardSpec read_placement(const JsonValue& p) {
  ShardSpec block;
  const std::vector<int64_t> full = p["full"].integers(3, 1, int64_t(1) << 34);
  const std::vector<int64_t> local = p["local"].integers(3, 1, int64_t(1) << 34);
  const std::vector<int64_t> offset = p["offset"].integers(3, 0, int64_t(1) << 34);
  for (size_t d = 0; d < 3; ++d) {
    check(local[d] <= full[d] && offset[d] <= full[d] - local[d], p.where(), ": block [", offset[d], ", ",
          offset[d] + local[d], ") of dimension ", d, " lies outside the variable's ", full[d]);
    block.full[d] = full[d];
    block.local[d] = local[d];
    block.offset[d] = offset[d];
  }
  int64_t size = 1;
  for (int64_t d : full)
    check(!__builtin_mul_overflow(size, d, &size) && size <= (int64_t(1) << 34), p.where(), ": full ",
          json(full).dump(), " is implausibly large");
  return block;
}

TrainedParameters read_trained_parameters(const std::string& manifest_or_file) {
  TrainedParameters out;
  const std::vector<std::string> files = checkpoint_files(manifest_or_file);
  std::map<std::string, std::vector<ShardSpec>> blocks;  // per sharded variable: its distinct blocks
  std::map<std::string, std::string> first_file;
  for (const std::string& file : files) {
    const CheckpointMetadata meta(file);
    out.mode = meta.text("mode");
    check(out.mode == "lora" || out.mode == "full", file, ": metadata mode must be lora or full, got \"",
          brief(out.mode), "\"");
    out.step = meta.integer("step", 0, int64_t(1) << 50);
    out.lora_rank = int(meta.integer("lora_rank", 0, 1 << 20));
    out.lora_alpha = meta.number("lora_alpha");
    const std::string placement_text = meta.text("placement");
    const json placement_doc = parse_json(placement_text.empty() ? "{}" : placement_text, file + ": metadata placement");
    const JsonValue placement(placement_doc, file, "placement");
    check(placement.is_object(), placement.where(), ": must be an object");
    for (const auto& [name, tensor] : read_safetensors(file)) {
      if (name.rfind("param/", 0) != 0) continue;
      const std::string path = name.substr(6);
      check(tensor.dtype == DType::F32, file, ": ", brief(name), " must be F32, got ", dtype_name(tensor.dtype));
      if (!placement.has(path)) {  // a single-process checkpoint: the whole variable
        check(files.size() == 1, file, ": ", brief(path), " has no placement, but the checkpoint has ", files.size(), " files");
        out.values[path] = to_f32(tensor);
        continue;
      }
      const ShardSpec block = read_placement(placement[path]);  // this file's block of the variable
      check(num_elements(tensor.shape) == block.local_size(), file, ": ", brief(path), " holds ",
            num_elements(tensor.shape), " values, its placement says ", block.local_size());
      // Blocks of one variable cover it; so the whole is at most (blocks × block size), bounded by the files.
      check(block.full_size() <= block.local_size() * int64_t(files.size()), placement[path].where(),
            ": a variable of ", block.full_size(), " values cannot be made of ", files.size(), " blocks of ",
            block.local_size());
      std::vector<float>& whole = out.values[path];
      if (whole.empty()) {
        whole.assign(size_t(block.full_size()), 0.f);
        first_file[path] = file;
      }
      check(blocks[path].empty() || block.full == blocks[path][0].full, placement[path].where(),
            ": the variable's shape differs from its shape in ", first_file[path]);
      // Replicated blocks repeat (same region in several files); distinct blocks must not overlap.
      bool repeat = false;
      for (const ShardSpec& other : blocks[path]) {
        if (same_region(other, block)) repeat = true;
        else check(!overlaps(other, block), placement[path].where(), ": block overlaps another block of the variable");
      }
      const std::vector<float> values = to_f32(tensor);
      place_block(values.data(), block, whole.data());
      if (!repeat) blocks[path].push_back(block);
    }
  }
  for (const auto& [path, parts] : blocks) {  // distinct, non-overlapping blocks: they cover it iff sizes add up
    int64_t covered = 0;
    for (const ShardSpec& b : parts) covered += b.local_size();
    check(covered == parts[0].full_size(), manifest_or_file, ": the blocks of ", brief(path), " cover ", covered, " of ",
          parts[0].full_size(), " values (a rank file is missing or its placement is wrong)");
  }
  return out;
}

CheckpointState read_checkpoint(const std::string& manifest_or_file, const std::string& mode,
                                const std::vector<CheckpointTensor>& tensors, DeviceMesh* mesh) {
  std::string path = manifest_or_file;
  const int processes = mesh ? mesh->size() : 1;
  if (is_manifest(manifest_or_file)) {
    const CheckpointManifest manifest = read_manifest(manifest_or_file);
    const std::vector<int64_t> this_mesh = mesh ? std::vector<int64_t>(mesh->shape().begin(), mesh->shape().end())
                                                : std::vector<int64_t>{1};
    check(processes > 1 && manifest.mesh == this_mesh, manifest_or_file, ": a sharded checkpoint of mesh ",
          json(manifest.mesh).dump(), "; resume it on that mesh (this run: ",
          mesh ? json(mesh->shape()).dump() : std::string("one process"), ")");
    path = manifest.files[size_t(mesh->comm().rank())];
  } else {
    check(processes == 1, manifest_or_file, ": a single-process checkpoint; resume it without a mesh");
  }
  const CheckpointMetadata meta(path);
  const std::map<std::string, HostTensor> stored = read_safetensors(path);
  check(meta.text("mode") == mode, path, ": checkpoint is for ", brief(meta.text("mode")), " training, this run is ", mode);
  for (const CheckpointTensor& t : tensors) {
    for (const std::string kind : {"param/", "momentum/", "velocity/"}) {
      auto it = stored.find(kind + t.path);
      check(it != stored.end(), path, ": missing ", kind + t.path, " (was the checkpoint made with other options?)");
      check(it->second.dtype == DType::F32 && size_t(num_elements(it->second.shape)) == t.size, path, ": ",
            kind + t.path, " has ", num_elements(it->second.shape), " values, expected ", t.size);
      const Span<float>& dst = kind == "param/" ? t.value : kind == "momentum/" ? t.momentum : t.velocity;
      need_host(dst, t.size, kind + t.path);
      std::memcpy(dst.data, it->second.data, t.size * 4);
    }
  }
  CheckpointState state;
  state.mode = meta.text("mode");
  state.step = meta.integer("step", 0, int64_t(1) << 50);
  state.iterations = meta.integer("iterations", 0, int64_t(1) << 50);
  state.epoch_loss_sum = meta.number("epoch_loss_sum");
  state.epoch_examples = meta.number("epoch_examples");
  state.epoch_correct = meta.number("epoch_correct");
  state.epoch_weight = meta.number("epoch_weight");
  return state;
}

}  // namespace meshtune
