// gguf_matmul.cpp's entry points: for ops.cpp's registrations and decode_layer.cpp's projections.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

namespace prefixcache::gguf {

// Checks that `blocks` are contiguous uint8 [out, row bytes] of `type` for `in` inputs.
void check_blocks(const at::Tensor& blocks, int64_t type, int64_t in);

// Which kernel takes a product of `tokens` activation rows: the decode kernel up to `decode`,
// the panel kernel (gguf_panel.h, where built) up to `panel`, sgemm on the decoded matrix past
// both (packed_weight.row_limits()).
struct RowLimits {
  int64_t decode, panel;
};

// x [tokens, in] (contiguous fp32) times the packed matrix: torch.ops.prefixcache.gguf_matmul.
// With `activation_bits` 8, rows the decode kernel takes meet a type's integer kernel where it
// has one (gguf_int8.h's contract); with 16, one or two rows do (past two the fp32 kernel is
// faster); every other product (and 32) keeps fp32 activations.
at::Tensor matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t in,
                  RowLimits limits, int64_t activation_bits);

// Whether `type` has the integer-activation kernels in this build: torch.ops.prefixcache.gguf_int8.
bool has_int8_kernel(int64_t type);

// The matrix in fp32 [out, in] (torch.ops.prefixcache.gguf_dequantize): the SIMD decoders,
// or the portable ones with `portable`.
at::Tensor dequantize(const at::Tensor& blocks, int64_t type, int64_t in, bool portable);

// Which decoders this build has ("avx512", "avx2", "portable"): torch.ops.prefixcache.gguf_simd.
std::string simd_name();

}  // namespace prefixcache::gguf
