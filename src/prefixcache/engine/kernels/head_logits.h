// The int4 head's logits from its planes' outputs: bound, candidates, exact refinement.
#pragma once

#include <ATen/core/Tensor.h>

namespace prefixcache {

// int4_head.Int4Head.__call__ after its int4 matmul, in one pass per row: approximate logits
// from `parts` [R, P * N] (bf16 plane outputs), each one's error bound, and exact logits
// (the fp32 matrix `weight` [N, K] times `hidden` [R, K], summed in double) for every token
// whose bound reaches the row's best lower bound. Returns [R, N] fp32.
at::Tensor head_logits(const at::Tensor& parts, const at::Tensor& hidden,
                       const at::Tensor& weight, const at::Tensor& norm,
                       const at::Tensor& error_norm, const at::Tensor& plane_norms,
                       int64_t planes, double safety);

}  // namespace prefixcache
