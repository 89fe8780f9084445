// The middle rows' kernel: a step that mixes decodes and prompt chunks brings 16-200
// activation rows, too many for the decode kernel (which decodes every weight again for each
// 8 rows) and too few to pay for the prefill kernel's whole fp32 copy of the matrix. Here
// each weight is decoded once per call, `kPanelRows` output rows at a time, into a panel that
// stays in L1/L2, and a register-blocked kernel multiplies it into every activation row: per
// input, one broadcast weight per output row meets `kLanes` activation rows per register.
// Same contract as gguf_matmul: each weight exactly its dequantized value, fp32 FMA sums.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gguf_avx2.h"

namespace prefixcache::gguf::panel {

#if defined(__AVX2__)
inline __m256i lanes8() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }  // lane i holds i
#endif

#if defined(__AVX512F__) && defined(__AVX512VL__)
#define PREFIXCACHE_GGUF_PANEL 1
#define PREFIXCACHE_GGUF_PANEL_AVX512 1
struct Vec {
  using T = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kPanelRows = 8;  // output rows decoded together
  static constexpr int kMaxGroups = 3;  // 8 x 3 accumulators of 32 registers
  static T zero() { return _mm512_setzero_ps(); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static T broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  // p[lane * stride] for the first `valid` lanes, zero past them.
  static T gather(const float* p, __m512i offsets, int valid) {
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    return _mm512_mask_i32gather_ps(zero(), mask, offsets, p, 4);
  }
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  static __m512i offsets(int32_t stride) {
    return _mm512_mullo_epi32(_mm512_set1_epi32(stride), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define PREFIXCACHE_GGUF_PANEL 1
struct Vec {
  using T = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kPanelRows = 6;  // 6 x 2 accumulators of 16 registers
  static constexpr int kMaxGroups = 2;
  static T zero() { return _mm256_setzero_ps(); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static T broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  // p[lane * stride] for the first `valid` lanes, zero past them.
  static T gather(const float* p, __m256i offsets, int valid) {
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), lanes8());
    return _mm256_mask_i32gather_ps(zero(), p, offsets, _mm256_castsi256_ps(mask), 4);
  }
  static float sum(T v) { return avx2::sum_lanes(v); }
  static __m256i offsets(int32_t stride) { return _mm256_mullo_epi32(_mm256_set1_epi32(stride), lanes8()); }
};
#endif

#ifdef PREFIXCACHE_GGUF_PANEL
constexpr int kLanes = Vec::kLanes, kPanelRows = Vec::kPanelRows, kMaxGroups = Vec::kMaxGroups;

// Activation rows transposed into groups of kLanes: xt[g][k][lane] = x[g * kLanes + lane, k],
// zero past the last row, so a register holds one input of kLanes rows.
inline void transpose_rows(const float* x, int64_t tokens, int64_t in, float* xt) {
  const auto offsets = Vec::offsets(static_cast<int32_t>(in));
  for (int64_t g = 0, groups = (tokens + kLanes - 1) / kLanes; g < groups; ++g) {
    const int valid = static_cast<int>(std::min<int64_t>(kLanes, tokens - g * kLanes));
    const float* rows = x + g * kLanes * in;
    float* dst = xt + g * in * kLanes;
    for (int64_t k = 0; k < in; ++k) Vec::store(dst + k * kLanes, Vec::gather(rows + k, offsets, valid));
  }
}

// c[r][g] (kLanes floats each) = panel row r . activation groups g, over `in` inputs: the
// panel is kPanelRows decoded rows `in` floats apart, xt as transpose_rows lays it out.
template <int Groups>
void multiply_panel(const float* panel, const float* xt, int64_t in, float* c) {
  typename Vec::T acc[kPanelRows][Groups];
#pragma GCC unroll 8
  for (int r = 0; r < kPanelRows; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < Groups; ++g) acc[r][g] = Vec::zero();
  for (int64_t k = 0; k < in; ++k) {
    typename Vec::T xs[Groups];
#pragma GCC unroll 4
    for (int g = 0; g < Groups; ++g) xs[g] = Vec::load(xt + (g * in + k) * kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) {
      const typename Vec::T w = Vec::broadcast(panel + r * in + k);
#pragma GCC unroll 4
      for (int g = 0; g < Groups; ++g) acc[r][g] = Vec::fma(w, xs[g], acc[r][g]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kPanelRows; ++r)
#pragma GCC unroll 4
    for (int g = 0; g < Groups; ++g) Vec::store(c + (r * Groups + g) * kLanes, acc[r][g]);
}

// Rows a last, mostly empty register group would hold go by dot products instead: `rest`
// rows cost about 2 * rest / kLanes of a group (a load per FMA). The dots read kLanes inputs
// at a time: `in` must be a multiple (every block type's is; F16/BF16 rows may not be).
inline bool dots_take(int64_t rest, int64_t in) { return rest > 0 && 2 * rest < kLanes && in % kLanes == 0; }

// y[t][r] = panel row r . x[t] for `rows` activation rows (`in` floats apart, as given) and
// r < `count`; y's rows `stride` floats apart.
inline void dot_panel(const float* panel, const float* x, int64_t rows, int64_t in, int count, float* y, int64_t stride) {
  for (int64_t t = 0; t < rows; ++t) {
    typename Vec::T acc[kPanelRows];
#pragma GCC unroll 8
    for (int r = 0; r < kPanelRows; ++r) acc[r] = Vec::zero();
    for (int64_t k = 0; k < in; k += kLanes) {
      const typename Vec::T xs = Vec::load(x + t * in + k);
#pragma GCC unroll 8
      for (int r = 0; r < kPanelRows; ++r) acc[r] = Vec::fma(Vec::load(panel + r * in + k), xs, acc[r]);
    }
    for (int r = 0; r < count; ++r) y[t * stride + r] = Vec::sum(acc[r]);
  }
}

// y[t][r] = c as multiply_panel leaves it (`groups` of kLanes rows t, for r < `count`), for
// t < rows, y's rows `stride` floats apart: one gathered vector of kPanelRows per t.
inline void store_tile(const float* c, int groups, int64_t rows, int count, float* y, int64_t stride) {
#ifdef PREFIXCACHE_GGUF_PANEL_AVX512
  const __m256i offsets = _mm256_mullo_epi32(_mm256_set1_epi32(groups * kLanes), lanes8());
  const __mmask8 mask = static_cast<__mmask8>((1u << count) - 1);
  for (int64_t t = 0; t < rows; ++t) {
    const float* col = c + (t / kLanes) * kLanes + t % kLanes;
    _mm256_mask_storeu_ps(y + t * stride, mask, _mm256_mmask_i32gather_ps(_mm256_setzero_ps(), mask, offsets, col, 4));
  }
#else
  for (int64_t t = 0; t < rows; ++t)
    for (int r = 0; r < count; ++r) y[t * stride + r] = c[(r * groups + t / kLanes) * kLanes + t % kLanes];
#endif
}

// multiply_panel for `groups` in 1..kMaxGroups.
inline void multiply(int groups, const float* panel, const float* xt, int64_t in, float* c) {
  if (groups == 1) return multiply_panel<1>(panel, xt, in, c);
  if (kMaxGroups == 2 || groups == 2) return multiply_panel<2>(panel, xt, in, c);
  multiply_panel<kMaxGroups>(panel, xt, in, c);
}
#endif

}  // namespace prefixcache::gguf::panel
