// Safetensors files (Hugging Face): an 8-byte little-endian header length, a JSON header
// {name: {dtype, shape, data_offsets:[begin,end]}, "__metadata__": {...}}, then the raw data.
// Reading memory-maps the file: tensors alias the map (zero copy), so a 2B model loads in seconds
// and is never held twice. Every header entry is validated against the file before use.
#pragma once
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace meshtune {

// All tensors of one .safetensors file, keyed by name. Supported dtypes: F32, BF16, F16, I32, I64,
// U8, BOOL. Throws Error naming the file (and tensor) for: missing/unreadable file, header length
// past the end of the file, header not JSON, unknown dtype, shape/offset disagreement, offsets
// outside the data, overlapping tensors.
std::map<std::string, HostTensor> read_safetensors(const std::string& path);
// The same from a file image in memory (tensors alias `bytes` and hold `owner`): what
// read_safetensors does after mapping the file; tests and the fuzzer call it directly.
std::map<std::string, HostTensor> parse_safetensors(const unsigned char* bytes, uint64_t size, const std::string& path,
                                                    std::shared_ptr<const void> owner = {});
// The header's "__metadata__" (string → string), reading the header only; errors name the file.
std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

// The tensors of a Hugging Face checkpoint directory: `model.safetensors`, or the shards listed in
// `model.safetensors.index.json` ({"weight_map": {name: file}}). Errors name the directory/file.
std::map<std::string, HostTensor> read_safetensors_dir(const std::string& dir);

// Writes tensors (in the given order) atomically: to `path + ".tmp"`, fsync, rename.
// The header is padded with spaces so that the data starts at an 8-byte boundary.
void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, HostTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata = {});
// The streaming form: the header is written from the declared dtypes and shapes, then tensor i's
// bytes from `tensor(i)`, made just before and released after, so a file far larger than memory
// can be written. A tensor that does not have its declared dtype and shape is an Error naming it.
void write_safetensors(const std::string& path, const std::vector<TensorSpec>& tensors, const TensorSource& tensor,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace meshtune
