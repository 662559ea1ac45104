// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord files use for their length and
// data checksums, plus TensorFlow's "masked" form of it.
#pragma once
#include <cstddef>
#include <cstdint>

namespace meshtune {

uint32_t crc32c(const void* data, size_t size);

// TFRecord stores ((crc >> 15) | (crc << 17)) + 0xa282ead8 so that a CRC of data that itself holds
// CRCs does not degenerate.
uint32_t masked_crc32c(const void* data, size_t size);

}  // namespace meshtune
