// Keras 3 `.weights.h5` files (read and written with libhdf5). Keras stores each variable as a
// dataset `<object path>/vars/<k>`, e.g. `layers/gemma_decoder_block_1/attention/query_dense/vars/0`;
// fp32 as H5T_IEEE_F32LE, bf16 as a 2-byte H5T_OPAQUE (raw bf16 bits) with attribute dtype="bfloat16".
// Large presets are sharded: `model.weights.json` = {"metadata":{"total_size":N},
// "weight_map":{"/layers/.../vars": "model_00000.weights.h5" | [files]}}.
#pragma once
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace meshtune {

// Every dataset in the file, keyed by its path without the leading '/'
// ("layers/reversible_embedding/vars/0", "lora/vars/rank"). Floating datasets come back as F32 or
// BF16 (any 2-byte opaque is bf16); integer ones as I32/I64; scalars have shape {}. Throws Error
// naming the file (and dataset) for a missing, truncated or corrupt file, external/virtual
// datasets, unsupported types, and "shape bombs" (declared size far beyond the file size).
// With `select`, a dataset for which it returns a box is read only there (an HDF5 hyperslab: the
// tensor gets the box's shape): sharded loading reads just this process' block of each variable.
struct DatasetBox {
  std::vector<int64_t> start, count;  // per dimension
};
using DatasetSelection = std::function<std::optional<DatasetBox>(const std::string& name, const Shape& shape)>;
std::map<std::string, HostTensor> read_h5_datasets(const std::string& path, const DatasetSelection& select = {});

// The datasets of a Keras preset directory: `model.weights.h5`, or the shards listed in
// `model.weights.json`. Keys as read_h5_datasets.
std::map<std::string, HostTensor> read_keras_weights_dir(const std::string& dir, const DatasetSelection& select = {});

// The same directory read one dataset at a time: the constructor lists the datasets (and checks
// the index and the files), `read` reads one (with the same checks as read_h5_datasets), so a
// loader can convert and free each before it reads the next — a model loads in about its own
// size, not the file's plus its own.
class KerasWeightsReader {
 public:
  explicit KerasWeightsReader(const std::string& dir);
  bool has(const std::string& name) const { return file_of_.count(name) > 0; }
  // Throws Error naming the dataset when it is absent. `select` as for read_h5_datasets. A
  // contiguous dataset comes as a view of the file's map, possibly misaligned for its dtype
  // (HostTensor::data: read it through memcpy).
  HostTensor read(const std::string& name, const DatasetSelection& select = {}) const;

 private:
  std::map<std::string, std::string> file_of_;  // dataset → the .h5 file holding it
};

// Writes datasets (keyed by path without leading '/') to a new .h5 file atomically (temp file,
// fsync, rename). Intermediate groups are created. F32 -> H5T_IEEE_F32LE, BF16 -> 2-byte opaque
// with attribute dtype="bfloat16", I32/I64 -> little-endian ints, shape {} -> scalar dataspace.
// `empty_groups` are created too (Keras writes empty `vars` groups for weightless layers).
void write_h5_datasets(const std::string& path, const std::vector<std::pair<std::string, HostTensor>>& datasets,
                       const std::vector<std::string>& empty_groups = {});
// The streaming form: dataset i is `datasets[i]` and made by `tensor(i)` just before it is written,
// then released, so a file far larger than memory can be written. A tensor that does not have its
// declared dtype and shape is an Error naming the dataset.
void write_h5_datasets(const std::string& path, const std::vector<TensorSpec>& datasets, const TensorSource& tensor,
                       const std::vector<std::string>& empty_groups = {});

}  // namespace meshtune
