// The integer-activation decode kernels (`--decode-activations int8|int16`), as llama.cpp's
// CPU dot products work: each 32 activations of a row become integer codes and one fp32
// scale, and each 32 weights meet them as their block's integer codes in integer
// multiply-adds. int8: one byte a code, one multiply-add. int16: a code of 15 bits kept as two
// bytes (code = 128 high + low, high in [-127, 127], low in [0, 127]), two multiply-adds.
//
// Numerical contract: x is replaced by x^ (per 32 inputs: L = 127 (int8) or 16,256 (int16),
// dx = amax / L, code = round-half-even(x * (L / amax)), x^ = code * dx); then y = W x^ with
// every weight its exact dequantized value (gguf_blocks.h) and fp32 sums, so y equals
// `x^ @ dequantize().T` up to fp32 summation order. The cost against fp32 activations is
// x - x^: at most dx / 2 an input (amax / 254 for int8, amax / 32,512 for int16). Compiled
// wherever AVX2 is (AVX-512 CPUs have it too); the types without a decoder here keep the
// fp32 kernel.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define PREFIXCACHE_GGUF_INT8 1
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "gguf_avx2.h"
#include "gguf_blocks.h"

namespace prefixcache::gguf::int8 {

// Rows of activations as the kernel reads them: row t's group g (inputs 32g..32g+31) has its
// codes at q + (t * groups + g) * 32 (int16: their high bytes there, their low bytes at the
// same place in `low`), its scale dx at d[t * groups + g], and dx times the sum of its codes
// at sum[t * groups + g] (what an affine type's minimum multiplies).
struct Activations {
  const int8_t* q;
  const int8_t* low;  // int16 only
  const float* d;
  const float* sum;
  int64_t groups;
};

// The largest code of `Bits`-bit activations (int16's high byte stays within [-127, 127]).
template <int Bits>
constexpr float kLimit = Bits == 8 ? 127.0f : 16256.0f;

// Row `x` (`in` floats) into codes (int16: high bytes in q, low in `low`), scales and sums (the
// contract above).
template <int Bits>
inline void quantize_row(const float* x, int64_t in, int8_t* q, int8_t* low, float* d, float* sum) {
  for (int64_t g = 0; g < in / 32; ++g, x += 32, q += 32, low += Bits == 16 ? 32 : 0) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float inverse = amax > 0.0f ? kLimit<Bits> / amax : 0.0f;
    int total = 0;
    for (int i = 0; i < 32; ++i) {
      const int code = static_cast<int>(std::nearbyint(x[i] * inverse));
      if constexpr (Bits == 8) {
        q[i] = static_cast<int8_t>(code);
      } else {
        q[i] = static_cast<int8_t>(code >> 7);  // floor(code / 128)
        low[i] = static_cast<int8_t>(code & 127);
      }
      total += code;
    }
    d[g] = amax / kLimit<Bits>;
    sum[g] = d[g] * static_cast<float>(total);
  }
}

using avx2::load32;
using avx2::sum_lanes;
inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// 32 nibbles from 16 bytes in natural order: the low nibbles (values 0..15), then the high.
inline __m256i nibbles16(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), bytes(15));
}

// 16 in byte j where bit j of `bits` is set (Q5_0/Q5_1's fifth bits).
inline __m256i sixteen_where(uint32_t bits) {
  const __m256i spread = _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101,
                                            0x0202020202020202, 0x0303030303030303);
  const __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), spread);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit), bytes(16));
}

// Q5_0/Q5_1's 5-bit codes: the nibbles at `qs` plus 16 where bit j of the 4 bytes at `qh` is set.
inline __m256i five_bit_codes(const uint8_t* qs, const uint8_t* qh) {
  return _mm256_or_si256(nibbles16(qs), sixteen_where(detail::u32_at(qh)));
}

// One group of 32 weights: codes q (signed, |q| <= 128; or unsigned, q < 64), the scale of
// values 0..15 and of 16..31 (a weight is a q, plus `min` for the unsigned types).
struct Group {
  __m256i q;
  float a_low, a_high, min;
};

// Each decoder: `kParts` groups a block, `State` what they share (gguf_blocks.h), `kSigned`.
struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18, kParts = 1;
  static constexpr bool kSigned = true;
  using State = NoState;
  static Group group(const uint8_t* b, const State&, int) {
    const float d = detail::half_at(b);
    return {_mm256_sub_epi8(nibbles16(b + 2), bytes(8)), d, d, 0.0f};
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20, kParts = 1;
  static constexpr bool kSigned = false;
  using State = NoState;
  static Group group(const uint8_t* b, const State&, int) {
    const float d = detail::half_at(b);
    return {nibbles16(b + 4), d, d, detail::half_at(b + 2)};
  }
};

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22, kParts = 1;
  static constexpr bool kSigned = true;
  using State = NoState;
  static Group group(const uint8_t* b, const State&, int) {
    const float d = detail::half_at(b);
    return {_mm256_sub_epi8(five_bit_codes(b + 6, b + 2), bytes(16)), d, d, 0.0f};
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24, kParts = 1;
  static constexpr bool kSigned = false;
  using State = NoState;
  static Group group(const uint8_t* b, const State&, int) {
    const float d = detail::half_at(b);
    return {five_bit_codes(b + 8, b + 4), d, d, detail::half_at(b + 2)};
  }
};

struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34, kParts = 1;
  static constexpr bool kSigned = true;
  using State = NoState;
  static Group group(const uint8_t* b, const State&, int) {
    const float d = detail::half_at(b);
    return {load32(b + 2), d, d, 0.0f};
  }
};

// Q4_K/Q5_K: sub-block p's nibbles, nibble p % 2 of the 32 bytes at 32 (p / 2).
inline __m256i k4_nibbles(const uint8_t* qs, int p) {
  const __m256i raw = load32(qs + 32 * (p / 2));
  return _mm256_and_si256(p % 2 ? _mm256_srli_epi16(raw, 4) : raw, bytes(15));
}

struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144, kParts = 8;
  static constexpr bool kSigned = false;
  using State = K4Scales;
  static Group group(const uint8_t* b, const State& s, int p) {
    return {k4_nibbles(b + 16, p), s.a[p], s.a[p], -s.m[p]};
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176, kParts = 8;
  static constexpr bool kSigned = false;
  using State = K4Scales;
  static Group group(const uint8_t* b, const State& s, int p) {
    // bit p of qh byte j is value j's fifth bit (16-bit shifts keep each byte's bits: masked)
    const __m256i top = _mm256_and_si256(_mm256_srl_epi16(load32(b + 16), _mm_cvtsi32_si128(p)), bytes(1));
    const __m256i q = _mm256_or_si256(k4_nibbles(b + 48, p), _mm256_slli_epi16(top, 4));
    return {q, s.a[p], s.a[p], -s.m[p]};
  }
};

struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210, kParts = 8;
  static constexpr bool kSigned = true;
  using State = K6Scales;
  static Group group(const uint8_t* b, const State& s, int p) {
    const int h = p / 4, k = p % 4;
    const __m256i low = load32(b + 64 * h + 32 * (k % 2));
    const __m256i nib = _mm256_and_si256(k < 2 ? low : _mm256_srli_epi16(low, 4), bytes(15));
    const __m256i high = _mm256_srl_epi16(load32(b + 128 + 32 * h), _mm_cvtsi32_si128(2 * k));
    const __m256i top = _mm256_and_si256(_mm256_slli_epi16(high, 4), bytes(0x30));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, top), bytes(32));
    return {q, s.a[8 * h + 2 * k], s.a[8 * h + 2 * k + 1], 0.0f};
  }
};

// The 16 int16 sums of 2 products each of weight codes `w` (unsigned, or with `Signed` signed)
// and activation bytes `x`: never saturated, as |w| <= 128 and |x| <= 127.
template <bool Signed>
inline __m256i pairs(__m256i w, __m256i w_abs, __m256i x) {
  return Signed ? _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(x, w)) : _mm256_maddubs_epi16(w, x);
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
// acc + the 8 sums of 4 products each of unsigned bytes u and signed bytes s (vpdpbusd).
inline __m256i dot_bytes(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)  // the same instruction, VEX-encoded (AVX2 CPUs with AVX-VNNI)
inline __m256i dot_bytes(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#endif

// The 8 sums of 4 products each of weight codes and activation codes (int16: 128 times the
// high bytes' plus the low bytes'): lane i covers values 4i..4i+3. With VNNI (AVX512-VNNI or
// AVX-VNNI) one vpdpbusd takes 4 products into each int32 lane (maddubs then madd without
// it): the same exact sums.
template <bool Signed, int Bits>
inline __m256 products(__m256i w, __m256i w_abs, __m256i x, __m256i x_low) {
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
  const __m256i u = Signed ? w_abs : w;  // unsigned weights, the activations signed to match
  const auto matched = [&](__m256i a) { return Signed ? _mm256_sign_epi8(a, w) : a; };
  const __m256i high = dot_bytes(_mm256_setzero_si256(), u, matched(x));
  if constexpr (Bits == 8) return _mm256_cvtepi32_ps(high);
  return _mm256_cvtepi32_ps(dot_bytes(_mm256_slli_epi32(high, 7), u, matched(x_low)));
#else
  const __m256i high = _mm256_madd_epi16(pairs<Signed>(w, w_abs, x), _mm256_set1_epi16(Bits == 8 ? 1 : 128));
  if constexpr (Bits == 8) return _mm256_cvtepi32_ps(high);
  const __m256i low = _mm256_madd_epi16(pairs<Signed>(w, w_abs, x_low), _mm256_set1_epi16(1));
  return _mm256_cvtepi32_ps(_mm256_add_epi32(high, low));
#endif
}

// y[t, r] = W[r] . x^[t] for `Rows` activation rows and output rows [first, last): each group
// decoded once, then per row one integer dot and one FMA into the row's one sum (two sums a
// row, picked by a runtime index, kept them out of registers: 1.2x over fp32, not 1.56x).
template <class D, int Rows, int Bits>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t in, const Activations& x,
              int64_t first, int64_t last, float* y, int64_t out) {
  constexpr bool kSplit = std::is_same_v<D, Q6_K>;  // two scales a group
  const int64_t blocks = in / D::kValues;
  for (int64_t r = first; r < last; ++r) {
    __m256 acc[Rows];
    float mins[Rows] = {};
    for (int t = 0; t < Rows; ++t) acc[t] = _mm256_setzero_ps();
    const uint8_t* block = w + r * row_bytes;
    int64_t g = 0;
    for (int64_t b = 0; b < blocks; ++b, block += D::kBytes) {
      prefetch_ahead<D::kBytes>(block);
      const typename D::State state(block);
      for (int p = 0; p < D::kParts; ++p, ++g) {
        const Group c = D::group(block, state, p);
        const __m256i w_abs = D::kSigned ? _mm256_sign_epi8(c.q, c.q) : c.q;
        for (int t = 0; t < Rows; ++t) {
          const int64_t at = t * x.groups + g;
          const __m256i codes = load32(reinterpret_cast<const uint8_t*>(x.q + at * 32));
          const __m256i low = Bits == 8 ? codes : load32(reinterpret_cast<const uint8_t*>(x.low + at * 32));
          const __m256 dot = products<D::kSigned, Bits>(c.q, w_abs, codes, low);
          const __m256 scale = kSplit ? _mm256_set_m128(_mm_set1_ps(c.a_high * x.d[at]), _mm_set1_ps(c.a_low * x.d[at]))
                                      : _mm256_set1_ps(c.a_low * x.d[at]);
          acc[t] = _mm256_fmadd_ps(scale, dot, acc[t]);
          if constexpr (!D::kSigned) mins[t] += c.min * x.sum[at];
        }
      }
    }
    for (int t = 0; t < Rows; ++t) y[t * out + r] = sum_lanes(acc[t]) + mins[t];
  }
}

}  // namespace prefixcache::gguf::int8
#endif
