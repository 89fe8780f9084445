// gguf_matmul.cpp's entry points for the other kernels (decode_layer.cpp's projections).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace prefixcache::gguf {

// Checks that `blocks` are contiguous uint8 [out, row bytes] of `type` for `in` inputs.
void check_blocks(const at::Tensor& blocks, int64_t type, int64_t in);

// x [tokens, in] (contiguous fp32) times the packed matrix: torch.ops.prefixcache.gguf_matmul.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t in,
                  int64_t max_decode_rows);

}  // namespace prefixcache::gguf
