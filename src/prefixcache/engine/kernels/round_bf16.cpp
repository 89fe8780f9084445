// x.to(bfloat16).to(float32) in one in-place pass: the int4 model's dense (prefill) path
// rounds its inputs and outputs to bf16 as the int4 kernel does, and two casts per side
// cost ~8% of a long prefill.
#include "round_bf16.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

namespace prefixcache {

void round_bf16_(at::Tensor& x) {
  TORCH_CHECK(x.dtype() == at::kFloat && x.is_contiguous(), "round_bf16_ needs contiguous fp32");
  uint32_t* bits = reinterpret_cast<uint32_t*>(x.data_ptr<float>());
  at::parallel_for(0, x.numel(), 1 << 16, [&](int64_t first, int64_t last) {
#pragma omp simd
    for (int64_t i = first; i < last; ++i) bits[i] = round_bf16_bits(bits[i]);
  });
}

}  // namespace prefixcache
