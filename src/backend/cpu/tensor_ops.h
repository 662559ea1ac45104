// The small data-movement and elementwise steps between the big kernels, so that model code reads
// like the math and holds no loops of its own: copies, residual adds, scaling, the embedding lookup
// (and its gradient), the KV-cache write, gathering and scattering rows.
#pragma once
#include <cstdint>
#include <vector>

#include "core/weight_matrix.h"

namespace meshtune {

void copy_values(const float* src, int64_t n, float* dst);  // dst = src
void fill_zeros(float* x, int64_t n);                   // x = 0
void add_into(float* x, const float* y, int64_t n);     // x += y
void scale_in_place(float* x, int64_t n, float factor);  // x *= factor

// out[m] = table row ids[m] − first_row (fp32) for the ids this table holds (rows first_row …
// first_row + table.rows − 1: a vocabulary-parallel part), zeros for the others.
void embedding_lookup(const WeightMatrix& table, int64_t first_row, const int32_t* ids, int64_t M, float factor,
                      float* out);
// Its gradient: grad[ids[m] − first_row] += factor · dy[m] for the rows this table holds.
void embedding_lookup_backward(const float* dy, const int32_t* ids, int64_t M, int64_t dim, int64_t first_row,
                               int64_t rows, float factor, float* grad);

// Writes [B, T, width] values into a cache of [B, capacity, width] at positions start … start+T−1.
void write_cache_rows(const float* values, int64_t B, int64_t T, int64_t width, int64_t capacity, int64_t start,
                      float* cache);

// dst[i] = src row rows[i] (gather), and dst row rows[i] = src[i] (scatter), rows of `dim` floats.
void gather_rows(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst);
void scatter_rows(const float* src, const int64_t* rows, int64_t n, int64_t dim, float* dst);

// `parts` blocks of [M, part] columns (block r = columns r·part …, as all_gather lays them out)
// interleaved into rows of [M, parts·part].
void interleave_column_blocks(const float* blocks, int parts, int64_t M, int64_t part, float* out);

}  // namespace meshtune
