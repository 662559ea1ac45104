#include "io/keras_h5.h"

#include <fcntl.h>
#include <hdf5.h>
#include <unistd.h>

#include <bit>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_util.h"
#include "core/json.h"
#include "io/mapped_files.h"

namespace meshtune {

static_assert(std::endian::native == std::endian::little, "raw bf16/f16 bytes assume a little-endian host");

namespace {

// libhdf5 keeps global state (and the Debian build serialises internally anyway); one lock keeps
// our calls and the error-stack handling below from interleaving between threads.
// Recursive: a streaming write's TensorSource may itself read an .h5 file on the writing thread.
std::recursive_mutex& h5_mutex() {
  static std::recursive_mutex m;
  return m;
}

// Stops libhdf5 from printing its error stack to stderr: we report errors ourselves. The setting
// is per thread in thread-safe builds, so every entry point calls this.
void silence_hdf5() { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

// The innermost message of libhdf5's error stack (where the problem was detected, e.g.
// "truncated file: eof = ..."), then clears the stack. Empty if there is none.
std::string h5_error_detail() {
  std::string detail;
  auto take_first = [](unsigned n, const H5E_error2_t* err, void* data) -> herr_t {
    auto* out = static_cast<std::string*>(data);
    if (n == 0 && err->desc) *out = err->desc;
    return 0;
  };
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_UPWARD, take_first, &detail);
  H5Eclear2(H5E_DEFAULT);
  // A failed write is reported as a dump ("file write failed: time = …, filename = …, errno = 27,
  // error message = 'File too large', buf = 0x…"): only the system's message matters.
  const std::string marker = "error message = '";
  if (const size_t at = detail.find(marker); at != std::string::npos) {
    const size_t end = detail.find('\'', at + marker.size());
    const std::string cause = detail.substr(at + marker.size(), end == std::string::npos ? std::string::npos : end - at - marker.size());
    detail = (detail.rfind("file write failed", 0) == 0 ? "write failed: " : "") + cause;
  }
  for (char& c : detail)  // one line: libhdf5's messages may span several
    if (c == '\n' || c == '\r') c = ' ';
  return detail.empty() ? std::string() : " (HDF5: " + brief(detail, 300) + ")";
}

// Owns one hid_t and closes it with the matching H5?close function.
class Handle {
 public:
  using Closer = herr_t (*)(hid_t);
  Handle() = default;
  Handle(hid_t id, Closer closer) : id_(id), closer_(closer) {}
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  Handle(Handle&& other) noexcept : id_(other.id_), closer_(other.closer_) { other.id_ = -1; }
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      reset();
      id_ = other.id_;
      closer_ = other.closer_;
      other.id_ = -1;
    }
    return *this;
  }
  ~Handle() { reset(); }

  hid_t get() const { return id_; }
  bool valid() const { return id_ >= 0; }
  // Closes now and reports the result (H5Fclose can fail while flushing).
  herr_t close() {
    herr_t status = id_ >= 0 ? closer_(id_) : 0;
    id_ = -1;
    return status;
  }

 private:
  void reset() {
    if (id_ >= 0) closer_(id_);
    id_ = -1;
  }
  hid_t id_ = -1;
  Closer closer_ = nullptr;
};

// Wraps a freshly returned id; a negative id becomes an Error naming `where` (file and object).
Handle checked(hid_t id, Handle::Closer closer, const std::string& where, const char* what) {
  if (id < 0) fail(where, ": ", what, " failed", h5_error_detail());
  return Handle(id, closer);
}

void check_status(herr_t status, const std::string& where, const char* what) {
  if (status < 0) fail(where, ": ", what, " failed", h5_error_detail());
}

// An IEEE half-precision little-endian type (libhdf5 1.10 has no predefined one); the caller closes it.
hid_t make_f16le_type() {
  hid_t t = H5Tcopy(H5T_IEEE_F32LE);
  if (t < 0) return t;
  if (H5Tset_fields(t, 15, 10, 5, 0, 10) < 0 || H5Tset_size(t, 2) < 0 || H5Tset_ebias(t, 15) < 0 ||
      H5Tset_precision(t, 16) < 0 || H5Tset_order(t, H5T_ORDER_LE) < 0) {
    H5Tclose(t);
    return -1;
  }
  return t;
}

std::string class_name(H5T_class_t c) {
  switch (c) {
    case H5T_INTEGER: return "integer";
    case H5T_FLOAT: return "float";
    case H5T_STRING: return "string";
    case H5T_BITFIELD: return "bitfield";
    case H5T_OPAQUE: return "opaque";
    case H5T_COMPOUND: return "compound";
    case H5T_REFERENCE: return "reference";
    case H5T_ENUM: return "enum";
    case H5T_VLEN: return "vlen";
    case H5T_ARRAY: return "array";
    default: return "unknown";
  }
}

// H5Lvisit callback: collects the names of all datasets reachable through hard links. It must not
// throw through the C library, so failures end the visit with -1.
herr_t collect_dataset(hid_t group, const char* name, const H5L_info_t* info, void* data) {
  if (info->type != H5L_TYPE_HARD) return 0;  // soft/external links: Keras writes none
  hid_t obj = H5Oopen(group, name, H5P_DEFAULT);
  if (obj < 0) return -1;
  H5I_type_t type = H5Iget_type(obj);
  H5Oclose(obj);
  if (type == H5I_BADID) return -1;
  if (type == H5I_DATASET) {
    try {
      static_cast<std::vector<std::string>*>(data)->push_back(name);
    } catch (...) {
      return -1;
    }
  }
  return 0;
}

// H5Dget_offset counts from the end of a user block (bytes before the HDF5 data); files with one
// (h5py never writes one) are read through libhdf5 rather than mapped at a shifted offset.
bool without_user_block(hid_t file) {
  Handle fcpl(H5Fget_create_plist(file), H5Pclose);
  hsize_t user_block = 1;
  return fcpl.get() >= 0 && H5Pget_userblock(fcpl.get(), &user_block) >= 0 && user_block == 0;
}

// Reading a dataset. `views_may_be_misaligned`: the caller reads a mapped view through memcpy (the
// loader), so a dataset at an offset misaligned for its type is mapped too; otherwise it is read.
HostTensor read_dataset(hid_t file, const std::string& path, const std::string& name, uint64_t file_size,
                        const DatasetSelection& select, bool views_may_be_misaligned) {
  const std::string where = "file " + path + ": dataset " + name;
  Handle dset = checked(H5Dopen2(file, name.c_str(), H5P_DEFAULT), H5Dclose, where, "H5Dopen");

  // Keras refuses external and virtual storage: they would read other files.
  H5D_layout_t layout;
  {
    Handle dcpl = checked(H5Dget_create_plist(dset.get()), H5Pclose, where, "H5Dget_create_plist");
    int external = H5Pget_external_count(dcpl.get());
    check_status(external, where, "H5Pget_external_count");
    if (external > 0) fail(where, ": uses external storage, which is not allowed");
    layout = H5Pget_layout(dcpl.get());
    if (layout < 0) fail(where, ": H5Pget_layout failed", h5_error_detail());
    if (layout == H5D_VIRTUAL) fail(where, ": is a virtual dataset, which is not allowed");
  }

  // Shape from the dataspace; a scalar has shape {}.
  Shape shape;
  {
    Handle space = checked(H5Dget_space(dset.get()), H5Sclose, where, "H5Dget_space");
    H5S_class_t space_class = H5Sget_simple_extent_type(space.get());
    if (space_class == H5S_NULL) fail(where, ": has a null dataspace (no data)");
    if (space_class == H5S_SIMPLE) {
      int rank = H5Sget_simple_extent_ndims(space.get());
      check_status(rank, where, "H5Sget_simple_extent_ndims");
      std::vector<hsize_t> dims(static_cast<size_t>(rank));
      check_status(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr), where, "H5Sget_simple_extent_dims");
      for (hsize_t d : dims) shape.push_back(int64_t(d));
    } else if (space_class != H5S_SCALAR) {
      fail(where, ": H5Sget_simple_extent_type failed", h5_error_detail());
    }
  }

  // Map the file type onto ours and pick the memory type libhdf5 converts into.
  Handle file_type = checked(H5Dget_type(dset.get()), H5Tclose, where, "H5Dget_type");
  H5T_class_t type_class = H5Tget_class(file_type.get());
  size_t type_size = H5Tget_size(file_type.get());
  if (type_class == H5T_NO_CLASS || type_size == 0) fail(where, ": cannot query its type", h5_error_detail());
  DType dtype;
  Handle owned_mem_type;  // only for types we create
  hid_t mem_type = -1;
  if (type_class == H5T_FLOAT && (type_size == 4 || type_size == 8)) {
    dtype = DType::F32;  // float64 is narrowed, as Keras does when assigning to a float32 variable
    mem_type = H5T_NATIVE_FLOAT;
  } else if (type_class == H5T_FLOAT && type_size == 2) {
    dtype = DType::F16;
    owned_mem_type = checked(make_f16le_type(), H5Tclose, where, "creating a float16 type");
    mem_type = owned_mem_type.get();
  } else if (type_class == H5T_OPAQUE && type_size == 2) {
    dtype = DType::BF16;  // raw bf16 bits (h5py's mapping of ml_dtypes.bfloat16)
    mem_type = file_type.get();
  } else if (type_class == H5T_INTEGER && type_size == 4) {
    dtype = DType::I32;
    mem_type = H5T_NATIVE_INT32;
  } else if (type_class == H5T_INTEGER && type_size == 8) {
    dtype = DType::I64;
    mem_type = H5T_NATIVE_INT64;
  } else if (type_class == H5T_INTEGER && type_size == 1 && H5Tget_sign(file_type.get()) == H5T_SGN_NONE) {
    dtype = DType::U8;
    mem_type = H5T_NATIVE_UINT8;
  } else if (type_class == H5T_INTEGER && type_size == 1 && H5Tget_sign(file_type.get()) == H5T_SGN_2) {
    dtype = DType::I8;  // Keras' int8 kernels
    mem_type = H5T_NATIVE_INT8;
  } else {
    fail(where, ": unsupported type (", class_name(type_class), " of ", type_size, " bytes)");
  }

  // Guard against "shape bombs": a tiny file declaring a huge dataset would make us allocate it.
  uint64_t count = 1;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(count, uint64_t(d), &count)) fail(where, ": shape ", shape_str(shape), " overflows");
  }
  uint64_t declared;
  if (__builtin_mul_overflow(count, uint64_t(dtype_size(dtype)), &declared) || declared > (uint64_t(1) << 62)) {
    fail(where, ": shape ", shape_str(shape), " is too large");
  }
  hsize_t stored = H5Dget_storage_size(dset.get());  // 0 for unallocated storage (and on error)
  // Contiguous data, once allocated, lies in the file itself, so it cannot exceed the file's size.
  bool bomb = declared > 16 * file_size + (1u << 20) && stored < declared;
  bool beyond_file = layout == H5D_CONTIGUOUS && stored > 0 && declared > file_size;
  if (bomb || beyond_file) {
    fail("file ", path, ": dataset ", name, " declares ", declared, " bytes but the file holds ", file_size);
  }

  const std::optional<DatasetBox> box = select ? select(name, shape) : std::nullopt;
  if (box) {  // a hyperslab: only the box's bytes are read
    check(box->start.size() == shape.size() && box->count.size() == shape.size(), where, ": a ",
          box->start.size(), "-d block was asked of a ", shape.size(), "-d dataset");
    std::vector<hsize_t> start, block;
    for (size_t d = 0; d < shape.size(); ++d) {
      check(box->start[d] >= 0 && box->count[d] >= 0 && box->start[d] + box->count[d] <= shape[d], where,
            ": block [", box->start[d], ", +", box->count[d], ") of dimension ", d, " is outside ", shape_str(shape));
      start.push_back(hsize_t(box->start[d]));
      block.push_back(hsize_t(box->count[d]));
    }
    HostTensor part = HostTensor::allocate(dtype, Shape(box->count.begin(), box->count.end()));
    if (part.nbytes() == 0) return part;
    Handle file_space = checked(H5Dget_space(dset.get()), H5Sclose, where, "H5Dget_space");
    check_status(H5Sselect_hyperslab(file_space.get(), H5S_SELECT_SET, start.data(), nullptr, block.data(), nullptr),
                 where, "H5Sselect_hyperslab");
    Handle mem_space = checked(H5Screate_simple(int(block.size()), block.data(), nullptr), H5Sclose, where, "H5Screate_simple");
    check_status(H5Dread(dset.get(), mem_type, mem_space.get(), file_space.get(), H5P_DEFAULT,
                         part.mutable_as<std::byte>()),
                 where, "H5Dread (block)");
    return part;
  }
  // Contiguous bytes already in the memory type (bf16, float32, int8: every Keras weight) are mapped,
  // not read, when aligned for it or when the caller copes (HDF5 packs datasets at any byte offset,
  // h5py's files are unaligned): the loader's permutation then reads the file's pages once, straight into the
  // final layout, instead of clearing fresh pages for a copy it throws away (a 7B preset's load
  // spent half its time so). Anything else goes through libhdf5's conversions.
  const haddr_t offset = H5Dget_offset(dset.get());
  if (layout == H5D_CONTIGUOUS && count > 0 && offset != HADDR_UNDEF && stored == declared &&
      H5Tequal(file_type.get(), mem_type) > 0 && (views_may_be_misaligned || offset % dtype_size(dtype) == 0) && offset <= file_size && declared <= file_size - offset &&
      without_user_block(file)) {
    const MappedRange map = map_file_range(path, offset, declared, /*read_ahead=*/true);
    HostTensor view;
    view.dtype = dtype;
    view.shape = shape;
    view.data = map.data;
    view.owner = map.owner;
    view.mapped = true;
    return view;
  }
  HostTensor tensor = HostTensor::allocate(dtype, shape);
  if (count > 0) {
    check_status(H5Dread(dset.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, tensor.mutable_as<std::byte>()), where,
                 "H5Dread");
  }
  return tensor;
}

// Creates `group` and any missing parents (existing ones are kept).
void ensure_group(hid_t file, const std::string& path, const std::string& group) {
  std::string prefix;
  size_t start = 0;
  while (start <= group.size()) {
    size_t end = group.find('/', start);
    if (end == std::string::npos) end = group.size();
    std::string part = group.substr(start, end - start);
    start = end + 1;
    if (part.empty()) continue;
    prefix += (prefix.empty() ? "" : "/") + part;
    const std::string where = "file " + path + ": group " + prefix;
    htri_t exists = H5Lexists(file, prefix.c_str(), H5P_DEFAULT);
    check_status(exists, where, "H5Lexists");
    if (!exists) checked(H5Gcreate2(file, prefix.c_str(), H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Gclose, where, "H5Gcreate");
  }
}

// Adds the scalar variable-length UTF-8 string attribute `name`=`value`, as h5py writes strings.
void write_string_attribute(hid_t object, const std::string& where, const char* name, const char* value) {
  Handle type = checked(H5Tcopy(H5T_C_S1), H5Tclose, where, "H5Tcopy");
  check_status(H5Tset_size(type.get(), H5T_VARIABLE), where, "H5Tset_size");
  check_status(H5Tset_cset(type.get(), H5T_CSET_UTF8), where, "H5Tset_cset");
  Handle space = checked(H5Screate(H5S_SCALAR), H5Sclose, where, "H5Screate");
  Handle attr = checked(H5Acreate2(object, name, type.get(), space.get(), H5P_DEFAULT, H5P_DEFAULT), H5Aclose, where,
                        "H5Acreate");
  check_status(H5Awrite(attr.get(), type.get(), &value), where, "H5Awrite");
}

void write_dataset(hid_t file, hid_t lcpl, const std::string& path, const std::string& name, const HostTensor& t) {
  const std::string where = "file " + path + ": dataset " + name;
  if (name.empty() || name == "/") fail("file ", path, ": empty dataset name");
  if (t.nbytes() > 0 && !t.data) fail(where, ": tensor has no data");

  // File type (what Keras/h5py write) and the memory type our bytes are in.
  Handle owned_file_type, owned_mem_type;
  hid_t file_type = -1, mem_type = -1;
  switch (t.dtype) {
    case DType::F32: file_type = H5T_IEEE_F32LE; mem_type = H5T_NATIVE_FLOAT; break;
    case DType::BF16:
      owned_file_type = checked(H5Tcreate(H5T_OPAQUE, 2), H5Tclose, where, "H5Tcreate(opaque)");
      file_type = mem_type = owned_file_type.get();
      break;
    case DType::F16:
      owned_file_type = checked(make_f16le_type(), H5Tclose, where, "creating a float16 type");
      file_type = mem_type = owned_file_type.get();
      break;
    case DType::I32: file_type = H5T_STD_I32LE; mem_type = H5T_NATIVE_INT32; break;
    case DType::I64: file_type = H5T_STD_I64LE; mem_type = H5T_NATIVE_INT64; break;
    case DType::I8: file_type = H5T_STD_I8LE; mem_type = H5T_NATIVE_INT8; break;
    case DType::U8: case DType::BOOL: file_type = H5T_STD_U8LE; mem_type = H5T_NATIVE_UINT8; break;
  }

  Handle space;
  if (t.shape.empty()) {
    space = checked(H5Screate(H5S_SCALAR), H5Sclose, where, "H5Screate");
  } else {
    std::vector<hsize_t> dims;
    for (int64_t d : t.shape) {
      if (d < 0) fail(where, ": negative dimension in shape ", shape_str(t.shape));
      dims.push_back(hsize_t(d));
    }
    space = checked(H5Screate_simple(int(dims.size()), dims.data(), nullptr), H5Sclose, where, "H5Screate_simple");
  }

  // Default creation properties: contiguous, uncompressed, fill value 0 (as Keras writes).
  Handle dset = checked(H5Dcreate2(file, name.c_str(), file_type, space.get(), lcpl, H5P_DEFAULT, H5P_DEFAULT),
                        H5Dclose, where, "H5Dcreate");
  if (t.nbytes() > 0) {
    check_status(H5Dwrite(dset.get(), mem_type, H5S_ALL, H5S_ALL, H5P_DEFAULT, t.data), where, "H5Dwrite");
  }
  if (t.dtype == DType::BF16) write_string_attribute(dset.get(), where, "dtype", "bfloat16");
}

void write_file(const std::string& tmp, const std::vector<TensorSpec>& datasets, const TensorSource& tensor,
                const std::vector<std::string>& empty_groups) {
  const std::string where = "file " + tmp;
  // Datasets of 4 KiB or more start on 64-byte boundaries, so that a reader can map them in place
  // (read_dataset maps only data aligned for its type; h5py packs at any byte).
  Handle fapl = checked(H5Pcreate(H5P_FILE_ACCESS), H5Pclose, where, "H5Pcreate(file access)");
  check_status(H5Pset_alignment(fapl.get(), 4096, 64), where, "H5Pset_alignment");
  Handle file = checked(H5Fcreate(tmp.c_str(), H5F_ACC_TRUNC, H5P_DEFAULT, fapl.get()), H5Fclose, where, "H5Fcreate");
  {
    Handle lcpl = checked(H5Pcreate(H5P_LINK_CREATE), H5Pclose, where, "H5Pcreate(link create)");
    check_status(H5Pset_create_intermediate_group(lcpl.get(), 1), where, "H5Pset_create_intermediate_group");
    for (size_t i = 0; i < datasets.size(); ++i) {
      const TensorSpec& spec = datasets[i];
      const HostTensor t = tensor(i);  // freed (unless someone else holds it) once written
      check_declared(t, spec, where);
      write_dataset(file.get(), lcpl.get(), tmp, spec.name, t);
    }
    for (const auto& group : empty_groups) ensure_group(file.get(), tmp, group);
  }
  check_status(file.close(), where, "H5Fclose");
}

}  // namespace

namespace {

// An HDF5 file opened for reading, checked first: it exists, is a regular HDF5 file, and its size.
struct OpenedFile {
  Handle file;
  uint64_t size = 0;
};

OpenedFile open_h5(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) fail("file ", path, ": no such file");
  if (!std::filesystem::is_regular_file(path, ec)) fail("file ", path, ": not a regular file");
  const uint64_t file_size = std::filesystem::file_size(path, ec);
  if (ec) fail("file ", path, ": cannot read its size: ", ec.message());
  htri_t is_hdf5 = H5Fis_hdf5(path.c_str());
  if (is_hdf5 <= 0) fail("file ", path, ": not an HDF5 file or truncated", h5_error_detail());
  // A truncated file may still open when its superblock survived; libhdf5 then fails on the first
  // read past the end, which becomes an Error too.
  return {checked(H5Fopen(path.c_str(), H5F_ACC_RDONLY, H5P_DEFAULT), H5Fclose, "file " + path,
                  "not an HDF5 file or truncated: H5Fopen"),
          file_size};
}

std::vector<std::string> dataset_names(const OpenedFile& f, const std::string& path) {
  std::vector<std::string> names;
  check_status(H5Lvisit(f.file.get(), H5_INDEX_NAME, H5_ITER_INC, collect_dataset, &names), "file " + path,
               "visiting the groups (corrupt or truncated file?)");
  return names;
}

// The .h5 files of a Keras preset directory: model.weights.h5, or the shards model.weights.json lists.
std::vector<std::string> keras_weight_files(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path json_path = fs::path(dir) / "model.weights.json";
  const fs::path h5_path = fs::path(dir) / "model.weights.h5";
  std::error_code ec;
  if (!fs::exists(json_path, ec)) {
    if (fs::exists(h5_path, ec)) return {h5_path.string()};
    fail("directory ", dir, ": has neither model.weights.h5 nor model.weights.json");
  }
  // Sharded: each shard named in weight_map once, in the order first listed.
  const json index = read_json_file(json_path.string());
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    fail("file ", json_path.string(), ": missing object \"weight_map\"");
  }
  std::vector<std::string> shards;
  std::set<std::string> seen;
  auto add_shard = [&](const json& value, const std::string& key) {
    const std::string what = json_path.string() + ": weight_map[\"" + brief(key) + "\"]";
    if (!value.is_string()) fail(what, " is not a file name");
    const std::string name = value.get<std::string>();
    // Shards live beside the json; refuse paths that would reach elsewhere.
    plain_file_in(dir, name, what);
    check(name.find('\\') == std::string::npos, what, ": \"", brief(name), "\" is not a plain file name");
    if (seen.insert(name).second) shards.push_back(name);
  };
  for (const auto& [key, value] : index["weight_map"].items()) {
    if (value.is_array()) {
      for (const auto& v : value) add_shard(v, key);
    } else {
      add_shard(value, key);
    }
  }
  if (shards.empty()) fail("file ", json_path.string(), ": weight_map lists no shard files");
  std::vector<std::string> files;
  for (const auto& shard : shards) {
    const fs::path shard_path = fs::path(dir) / shard;
    if (!fs::is_regular_file(shard_path, ec)) {
      fail_not_found("file ", json_path.string(), ": lists shard ", shard, " but ", shard_path.string(), " does not exist");
    }
    files.push_back(shard_path.string());
  }
  return files;
}

}  // namespace

std::map<std::string, HostTensor> read_h5_datasets(const std::string& path, const DatasetSelection& select) {
  std::lock_guard lock(h5_mutex());
  silence_hdf5();
  const OpenedFile f = open_h5(path);
  std::map<std::string, HostTensor> out;
  for (const auto& name : dataset_names(f, path)) out[name] = read_dataset(f.file.get(), path, name, f.size, select, false);
  return out;
}

std::map<std::string, HostTensor> read_keras_weights_dir(const std::string& dir, const DatasetSelection& select) {
  std::map<std::string, HostTensor> merged;
  for (const std::string& file : keras_weight_files(dir))
    for (auto& [name, tensor] : read_h5_datasets(file, select)) merged.insert_or_assign(name, std::move(tensor));
  return merged;
}

KerasWeightsReader::KerasWeightsReader(const std::string& dir) {
  std::lock_guard lock(h5_mutex());
  silence_hdf5();
  for (const std::string& file : keras_weight_files(dir)) {
    const OpenedFile f = open_h5(file);
    for (const auto& name : dataset_names(f, file)) file_of_.insert_or_assign(name, file);  // later shards win
  }
}

HostTensor KerasWeightsReader::read(const std::string& name, const DatasetSelection& select) const {
  auto it = file_of_.find(name);
  check(it != file_of_.end(), "no dataset ", name, " in the preset's weights");
  std::lock_guard lock(h5_mutex());
  silence_hdf5();
  const OpenedFile f = open_h5(it->second);
  return read_dataset(f.file.get(), it->second, name, f.size, select, /*views_may_be_misaligned=*/true);
}

void write_h5_datasets(const std::string& path, const std::vector<TensorSpec>& datasets, const TensorSource& tensor,
                       const std::vector<std::string>& empty_groups) {
  std::lock_guard lock(h5_mutex());
  silence_hdf5();
  // All handles are closed when write_file returns or throws.
  write_atomically(path, [&](const std::string& tmp) { write_file(tmp, datasets, tensor, empty_groups); });
}

void write_h5_datasets(const std::string& path, const std::vector<std::pair<std::string, HostTensor>>& datasets,
                       const std::vector<std::string>& empty_groups) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : datasets) specs.push_back({name, t.dtype, t.shape});
  write_h5_datasets(path, specs, [&](size_t i) { return datasets[i].second; }, empty_groups);
}

}  // namespace meshtune
