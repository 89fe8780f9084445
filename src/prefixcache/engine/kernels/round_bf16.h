// fp32 values rounded to bfloat16 precision, kept in fp32 (round_bf16.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace prefixcache {

// The bits of the bf16 nearest to fp32 `bits` (ties to even) in the high half, the low
// half zero; NaN stays NaN (quietened), inf stays inf. As torch's fp32 -> bf16 cast.
inline uint32_t round_bf16_bits(uint32_t bits) {
  if ((bits & 0x7f800000u) == 0x7f800000u) {
    return (bits & 0x007fffffu) ? (bits | 0x00400000u) & 0xffff0000u : bits;
  }
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
}

// `x` (fp32, contiguous) with every value rounded to the nearest bf16 (ties to even), in
// place: what x.to(bfloat16).to(float32) gives, in one pass and no allocation.
void round_bf16_(at::Tensor& x);

}  // namespace prefixcache
