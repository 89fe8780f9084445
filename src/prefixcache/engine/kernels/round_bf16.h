// fp32 values rounded to bfloat16 precision, kept in fp32 (round_bf16.cpp).
#pragma once

#include <ATen/ATen.h>

namespace prefixcache {

// `x` (fp32, contiguous) with every value rounded to the nearest bf16 (ties to even), in
// place: what x.to(bfloat16).to(float32) gives, in one pass and no allocation.
void round_bf16_(at::Tensor& x);

}  // namespace prefixcache
