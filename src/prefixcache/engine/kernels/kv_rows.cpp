// One pass each way between fp32 rows and a paged pool: the torch path takes index_select,
// then a widening copy (bf16), or a cast and a multiply (int8); and ~10 ops to quantize.
#include "kv_rows.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "round_bf16.h"

namespace prefixcache {

namespace {

void widen_bf16(const uint16_t* in, float* out, int64_t count) {
  uint32_t* bits = reinterpret_cast<uint32_t*>(out);
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) bits[i] = static_cast<uint32_t>(in[i]) << 16;
}

// Rows of dim int8 codes followed by their fp32 scale: code * scale, as dequantize_codes.
void widen_int8(const uint8_t* in, float* out, int64_t rows, int64_t dim) {
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* codes = reinterpret_cast<const int8_t*>(in + r * (dim + 4));
    float scale;
    std::memcpy(&scale, in + r * (dim + 4) + dim, sizeof(float));
    float* row = out + r * dim;
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) row[i] = static_cast<float>(codes[i]) * scale;
  }
}

}  // namespace

// How `cache` stores K/V rows of `dim` values (fp32, bf16, or int8 packed with its scale in
// uint8 rows of dim + 4 bytes), and one head's row in bytes.
std::pair<KVFormat, int64_t> cache_format(const at::Tensor& cache, int64_t dim) {
  TORCH_CHECK(cache.is_contiguous(), "cache must be contiguous");
  if (cache.dtype() == at::kFloat) return {KVFormat::kFloat32, dim * 4};
  if (cache.dtype() == at::kBFloat16) return {KVFormat::kBFloat16, dim * 2};
  TORCH_CHECK(cache.dtype() == at::kByte && cache.size(-1) == dim + 4,
              "cache must be fp32, bf16, or uint8 rows of int8 codes and an fp32 scale (",
              dim + 4, " bytes)");
  return {KVFormat::kInt8, dim + 4};
}

const int64_t* checked_rows(const at::Tensor& rows, const at::Tensor& cache, int64_t kv_heads,
                            int64_t head_bytes) {
  int64_t count = cache.numel() * cache.element_size() / (kv_heads * head_bytes);
  TORCH_CHECK(count >= 1, "cache must hold at least one row");
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(r[i] >= 0 && r[i] < count, "cache row ", r[i], " outside 0..", count - 1);
  }
  return r;
}

void store_row(float* x, int64_t dim, KVFormat format, uint8_t* out) {
  if (format == KVFormat::kFloat32) {
    std::memcpy(out, x, dim * sizeof(float));
  } else if (format == KVFormat::kBFloat16) {
    for (int64_t i = 0; i < dim; ++i) {
      uint32_t bits;
      std::memcpy(&bits, x + i, sizeof bits);
      bits = round_bf16_bits(bits);
      uint16_t high = static_cast<uint16_t>(bits >> 16);
      std::memcpy(out + 2 * i, &high, sizeof high);
      std::memcpy(x + i, &bits, sizeof bits);
    }
  } else {
    float absmax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) absmax = std::max(absmax, std::fabs(x[i]));
    const float scale = absmax * static_cast<float>(1.0 / 127.0);
    for (int64_t i = 0; i < dim; ++i) {
      float code = scale > 0.0f ? std::nearbyint(x[i] / scale) : 0.0f;
      code = std::min(127.0f, std::max(-127.0f, code));
      out[i] = static_cast<uint8_t>(static_cast<int8_t>(code));
      x[i] = code * scale;
    }
    std::memcpy(out + dim, &scale, sizeof scale);
  }
}

at::Tensor gather_kv(const at::Tensor& cache, int64_t which, const at::Tensor& block_ids) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.is_contiguous(),
              "cache must be contiguous [blocks, 2, block_size, kv_heads, width]");
  TORCH_CHECK(which == 0 || which == 1, "which must be 0 (K) or 1 (V), not ", which);
  TORCH_CHECK(block_ids.dtype() == at::kLong && block_ids.dim() == 1, "block_ids must be int64 [n]");
  auto ids = block_ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const int64_t blocks = cache.size(0), n = ids.numel();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < blocks, "block id ", id[i], " outside 0..", blocks - 1);
  }
  const int64_t rows = cache.size(2) * cache.size(3), width = cache.size(4);
  const bool int8 = cache.dtype() == at::kByte;
  TORCH_CHECK(!int8 || width > 4, "int8 rows need codes and a 4-byte scale");
  const int64_t dim = int8 ? width - 4 : width;
  const KVFormat format = cache_format(cache, dim).first;
  auto out = at::empty({n * cache.size(2), cache.size(3), dim}, cache.options().dtype(at::kFloat));
  const auto* base = static_cast<const uint8_t*>(cache.data_ptr());
  const int64_t half = rows * width * cache.element_size();  // bytes of K (or V) in a block
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const uint8_t* src = base + (id[b] * 2 + which) * half;
      float* to = dst + b * rows * dim;
      if (format == KVFormat::kInt8) {
        widen_int8(src, to, rows, dim);
      } else if (format == KVFormat::kBFloat16) {
        widen_bf16(reinterpret_cast<const uint16_t*>(src), to, rows * dim);
      } else {
        std::memcpy(to, src, rows * dim * sizeof(float));
      }
    }
  });
  return out;
}

void write_kv(const at::Tensor& cache, const at::Tensor& rows, at::Tensor& k, at::Tensor& v) {
  TORCH_CHECK(cache.dim() == 5 && cache.size(1) == 2 && cache.is_contiguous(),
              "cache must be contiguous [blocks, 2, block_size, kv_heads, width]");
  const int64_t kv_heads = cache.size(3), width = cache.size(4);
  TORCH_CHECK(k.dtype() == at::kFloat && k.is_contiguous() && v.dtype() == at::kFloat &&
                  v.is_contiguous() && k.sizes() == v.sizes() && k.dim() == 3 &&
                  k.size(1) == kv_heads,
              "k, v must be contiguous fp32 [T, ", kv_heads, ", dim]");
  const int64_t tokens = k.size(0), dim = k.size(2);
  auto [format, head_bytes] = cache_format(cache, dim);
  TORCH_CHECK(width * cache.element_size() == head_bytes, "cache rows of ", width,
              " do not hold ", dim, " values");
  TORCH_CHECK(rows.dtype() == at::kLong && rows.is_contiguous() && rows.dim() == 2 &&
                  rows.size(0) == tokens && rows.size(1) == 2,
              "rows must be contiguous int64 [", tokens, ", 2]");
  const int64_t* r = checked_rows(rows, cache, kv_heads, head_bytes);
  auto* base = static_cast<uint8_t*>(cache.data_ptr());
  float* keys = k.data_ptr<float>();
  float* values = v.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < kv_heads; ++h) {
      int64_t offset = (t * kv_heads + h) * dim;
      store_row(keys + offset, dim, format, base + (r[2 * t] * kv_heads + h) * head_bytes);
      store_row(values + offset, dim, format, base + (r[2 * t + 1] * kv_heads + h) * head_bytes);
    }
  }
}

}  // namespace prefixcache
