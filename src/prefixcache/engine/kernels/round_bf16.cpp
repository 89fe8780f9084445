// x.to(bfloat16).to(float32) in one in-place pass: the int4 model's dense (prefill) path
// rounds its inputs and outputs to bf16 as the int4 kernel does, and two casts per side
// cost ~8% of a long prefill.
#include "round_bf16.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace prefixcache {

namespace {

// Round to nearest, ties to even, on the bits; NaN stays NaN (quietened), inf stays inf.
inline uint32_t rounded(uint32_t bits) {
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    return (bits & 0x007fffffu) ? (bits | 0x00400000u) & 0xffff0000u : bits;
  }
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}

}  // namespace

void round_bf16_(at::Tensor& x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous(), "round_bf16_ needs contiguous fp32");
  uint32_t* bits = reinterpret_cast<uint32_t*>(x.data_ptr<float>());
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t first, int64_t last) {
#pragma omp simd
    for (int64_t i = first; i < last; ++i) bits[i] = rounded(bits[i]);
  });
}

}  // namespace prefixcache
