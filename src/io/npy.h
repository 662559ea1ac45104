// NumPy .npy files (format 1.0/2.0/3.0, little-endian, C order): what `meshtune logits` reads and
// writes, and what the Keras fixtures hold.
#pragma once
#include <string>

#include "core/tensor.h"

namespace meshtune {

// Reads '<f4', '<i4', '<i8', '|b1', '|u1', '<f2' arrays. Throws Error naming the file for a bad
// magic, unsupported dtype, Fortran order, or data shorter than the header says.
HostTensor read_npy(const std::string& path);

// Writes a C-order array (F32 '<f4', I32 '<i4', I64 '<i8', BOOL '|b1', U8 '|u1') atomically.
void write_npy(const std::string& path, const HostTensor& tensor);

}  // namespace meshtune
