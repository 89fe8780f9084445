// int4_head.Int4Head's bound and refinement after the planes' matmul, in C++: one pass over
// the vocabulary per row instead of ~15 torch ops over 49,152 logits (its docstring derives
// the bound; this evaluates the same expression, then the same safety factor).
#include "head_logits.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace prefixcache {

namespace {

constexpr double kUnit = 1.0 / 256;  // u = 2^-8, bf16 rounding

float bf16_to_float(const at::BFloat16& v) { return static_cast<float>(v); }

// The bound's per-row terms: |h' - h|, |h| and the fp32 accumulation term.
struct RowNorms {
  float dh, h, accumulate;
};

RowNorms row_norms(const float* h, int64_t k) {
  double sum_h = 0, sum_h16 = 0, sum_dh = 0;
  for (int64_t i = 0; i < k; ++i) {
    float h16 = static_cast<float>(at::BFloat16(h[i]));
    sum_h += static_cast<double>(h[i]) * h[i];
    sum_h16 += static_cast<double>(h16) * h16;
    sum_dh += static_cast<double>(h16 - h[i]) * (h16 - h[i]);
  }
  float accumulate = static_cast<float>(k * std::ldexp(1.0, -24) * std::sqrt(sum_h16));
  return {static_cast<float>(std::sqrt(sum_dh)), static_cast<float>(std::sqrt(sum_h)), accumulate};
}

float exact_logit(const float* w, const float* h, int64_t k) {
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += static_cast<double>(w[i]) * h[i];
  return static_cast<float>(sum);
}

}  // namespace

at::Tensor head_logits(const at::Tensor& parts, const at::Tensor& hidden,
                       const at::Tensor& weight, const at::Tensor& norm,
                       const at::Tensor& error_norm, const at::Tensor& plane_norms,
                       int64_t planes, double safety) {
  int64_t rows = hidden.size(0), k = hidden.size(1), n = weight.size(0);
  at::Tensor out = at::empty({rows, n}, hidden.options());
  const at::BFloat16* p = parts.data_ptr<at::BFloat16>();
  const float *w = weight.data_ptr<float>(), *norms = norm.data_ptr<float>();
  const float *errors = error_norm.data_ptr<float>(), *plane = plane_norms.data_ptr<float>();
  const float scale = static_cast<float>(kUnit / (1 - kUnit)), tiny = std::ldexp(1.0f, -23);
  std::vector<float> bounds(n);
  for (int64_t r = 0; r < rows; ++r) {
    const float* h = hidden.data_ptr<float>() + r * k;
    const at::BFloat16* row = p + r * planes * n;
    float* logits = out.data_ptr<float>() + r * n;
    RowNorms rn = row_norms(h, k);
    float best_low = -INFINITY;
    for (int64_t j = 0; j < n; ++j) {
      float approx = 0, magnitude = 0;
      for (int64_t q = 0; q < planes; ++q) {
        float part = bf16_to_float(row[q * n + j]);
        approx += part;
        magnitude += std::fabs(part);
      }
      float bound = rn.dh * norms[j] + rn.h * errors[j] + rn.accumulate * plane[j];
      bound = (bound + magnitude * scale + std::fabs(approx) * tiny) * static_cast<float>(safety);
      logits[j] = approx;
      bounds[j] = bound;
      best_low = std::max(best_low, approx - bound);
    }
    for (int64_t j = 0; j < n; ++j) {
      if (logits[j] + bounds[j] >= best_low) logits[j] = exact_logit(w + j * k, h, k);
    }
  }
  return out;
}

}  // namespace prefixcache
