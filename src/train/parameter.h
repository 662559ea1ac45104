// A trainable variable as the optimizer sees it: a flat fp32 value with its gradient, both in the
// memory of the backend that trains (device-tagged spans), plus the Keras names that weight-decay
// exclusion and checkpoints use.
#pragma once
#include <string>

#include "core/buffer.h"
#include "core/tensor.h"

namespace meshtune {

struct Parameter {
  std::string path;  // Keras variable path, e.g. "decoder_block_0/attention/query/lora_kernel_a"
  std::string name;  // Keras short name (the last path component): "lora_kernel_a", "scale", "kernel"
  Shape shape;
  Span<float> value, grad;  // `size` elements each
  size_t size = 0;          // number of elements
};

}  // namespace meshtune
