// Paged K/V rows in the pool's format (fp32, bf16, or int8 codes and a scale): stored from
// fp32 in one pass, or gathered and widened to fp32 in one pass (attention's eager path).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

namespace prefixcache {

// How the paged cache stores a (token, KV head) row of `dim` values: fp32, bf16, or int8
// codes followed by their fp32 scale, absmax / 127 (engine/kv_quant.py), dim + 4 bytes.
enum class KVFormat { kFloat32, kBFloat16, kInt8 };

// How `cache` stores K/V rows of `dim` values (fp32, bf16, or int8 packed with its scale in
// uint8 rows of dim + 4 bytes), and one head's row in bytes.
std::pair<KVFormat, int64_t> cache_format(const at::Tensor& cache, int64_t dim);

// `rows`' values, each checked to be a row of `cache` (rows of kv_heads x head_bytes).
const int64_t* checked_rows(const at::Tensor& rows, const at::Tensor& cache, int64_t kv_heads,
                            int64_t head_bytes);

// One head's row x [dim] into the cache at `out` as `format` keeps it; x becomes the values
// a read gives back (engine/kv_store.py's write and engine/kv_quant.py, bit for bit).
void store_row(float* x, int64_t dim, KVFormat format, uint8_t* out);

// `cache` [blocks, 2, block_size, kv_heads, width] (fp32, bf16, or uint8 int8 rows of
// dim codes and an fp32 scale): the `which` (0 K, 1 V) rows of `block_ids`, as fp32
// [len(block_ids) * block_size, kv_heads, dim]; the same values as the torch path.
at::Tensor gather_kv(const at::Tensor& cache, int64_t which, const at::Tensor& block_ids);

// k, v [T, kv_heads, dim] fp32 into `cache`'s rows `rows` [T, 2] (K row, V row of its
// [blocks * 2 * block_size] view); k and v become the values a read gives back.
void write_kv(const at::Tensor& cache, const at::Tensor& rows, at::Tensor& k, at::Tensor& v);

}  // namespace prefixcache
