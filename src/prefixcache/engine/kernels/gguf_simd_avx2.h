// AVX2 + FMA decoders for CPUs without AVX-512 (AMD Zen 2/3, older Intel): gguf_simd.h's
// interface with 8 lanes. A part's 32 values land in four registers, v[i] = values 8i..8i+7,
// the same values as gguf_blocks.h (each `a * q` exact, then one rounding for `- m`/`+ m`,
// so FMA or not gives the reference's bits). Codes become floats by widening, not lookup:
// AVX2 has no 16-entry permute.
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(PREFIXCACHE_GGUF_AVX512)
#define PREFIXCACHE_GGUF_AVX2 1
#include <immintrin.h>

#include "gguf_blocks.h"

namespace prefixcache::gguf::simd {

using Part = __m256[4];  // one part's 32 values

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(15)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)); }

// 16 signed byte codes times `a` into two registers.
inline void scaled_i8(__m128i codes, __m256 a, __m256* v) {
  v[0] = _mm256_mul_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
  v[1] = _mm256_mul_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8))));
}

// 16 unsigned byte codes as `a q + m` (m may be a negated minimum) into two registers.
inline void affine_u8(__m128i codes, __m256 a, __m256 m, __m256* v) {
  v[0] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)), m);
  v[1] = _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8))), m);
}

// 16 where bit j of `bits` (16 of them) is set, for byte j; 0 elsewhere.
inline __m128i sixteen_where(uint32_t bits) {
  const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)), spread);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(bytes, bit), bit), _mm_set1_epi8(16));
}

// 16 where bit `bit` of byte j of the 16 bytes at `p` is set.
inline __m128i sixteen_where_bit(const uint8_t* p, int bit) {
  const __m128i mask = _mm_set1_epi8(static_cast<char>(1 << bit));
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(load16(p), mask), mask), _mm_set1_epi8(16));
}

struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    const __m256 d = _mm256_set1_ps(detail::half_at(b));
    scaled_i8(load16(b + 2), d, v);
    scaled_i8(load16(b + 18), d, v + 2);
  }
};

struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    const __m256 d = _mm256_set1_ps(detail::half_at(b));
    const __m128i q = load16(b + 2), eight = _mm_set1_epi8(8);
    scaled_i8(_mm_sub_epi8(low_nibbles(q), eight), d, v);  // d (q - 8)
    scaled_i8(_mm_sub_epi8(high_nibbles(q), eight), d, v + 2);
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    const __m256 d = _mm256_set1_ps(detail::half_at(b)), m = _mm256_set1_ps(detail::half_at(b + 2));
    const __m128i q = load16(b + 4);
    affine_u8(low_nibbles(q), d, m, v);  // d q + m
    affine_u8(high_nibbles(q), d, m, v + 2);
  }
};

// Q5_0/Q5_1: the nibbles plus 16 where bit j of qh is set.
inline void five_bits(const uint8_t* qs, uint32_t qh, __m128i& lo, __m128i& hi) {
  const __m128i q = load16(qs);
  lo = _mm_or_si128(low_nibbles(q), sixteen_where(qh & 0xFFFF));
  hi = _mm_or_si128(high_nibbles(q), sixteen_where(qh >> 16));
}

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    const __m256 d = _mm256_set1_ps(detail::half_at(b));
    __m128i l, h;
    five_bits(b + 6, detail::u32_at(b + 2), l, h);
    const __m128i sixteen = _mm_set1_epi8(16);
    scaled_i8(_mm_sub_epi8(l, sixteen), d, v);  // d (q - 16)
    scaled_i8(_mm_sub_epi8(h, sixteen), d, v + 2);
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    const __m256 d = _mm256_set1_ps(detail::half_at(b)), m = _mm256_set1_ps(detail::half_at(b + 2));
    __m128i l, h;
    five_bits(b + 8, detail::u32_at(b + 4), l, h);
    affine_u8(l, d, m, v);
    affine_u8(h, d, m, v + 2);
  }
};

// Q4_K/Q5_K: sub-block p's codes (nibble p % 2 of the 32 bytes at 32 (p / 2)).
inline void k4_codes(const uint8_t* qs, int p, __m128i& lo, __m128i& hi) {
  const uint8_t* q = qs + 32 * (p / 2);
  lo = p % 2 == 0 ? low_nibbles(load16(q)) : high_nibbles(load16(q));
  hi = p % 2 == 0 ? low_nibbles(load16(q + 16)) : high_nibbles(load16(q + 16));
}

struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144, kParts = 8;
  using State = K4Scales;
  static void part(const uint8_t* b, const State& s, int p, Part& v) {
    const __m256 a = _mm256_set1_ps(s.a[p]), m = _mm256_set1_ps(-s.m[p]);
    __m128i l, h;
    k4_codes(b + 16, p, l, h);
    affine_u8(l, a, m, v);  // a q - m
    affine_u8(h, a, m, v + 2);
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176, kParts = 8;
  using State = K4Scales;
  static void part(const uint8_t* b, const State& s, int p, Part& v) {
    const __m256 a = _mm256_set1_ps(s.a[p]), m = _mm256_set1_ps(-s.m[p]);
    __m128i l, h;
    k4_codes(b + 48, p, l, h);
    affine_u8(_mm_or_si128(l, sixteen_where_bit(b + 16, p)), a, m, v);
    affine_u8(_mm_or_si128(h, sixteen_where_bit(b + 32, p)), a, m, v + 2);
  }
};

struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210, kParts = 8;
  using State = K6Scales;
  static void part(const uint8_t* b, const State& s, int p, Part& v) {
    const int h = p / 4, k = p % 4;
    const uint8_t* low = b + 64 * h + 32 * (k % 2);
    const uint8_t* high = b + 128 + 32 * h;
    const __m128i mask3 = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    for (int i = 0; i < 2; ++i) {
      __m128i l = k < 2 ? low_nibbles(load16(low + 16 * i)) : high_nibbles(load16(low + 16 * i));
      __m128i top = _mm_and_si128(_mm_srl_epi16(load16(high + 16 * i), _mm_cvtsi32_si128(2 * k)), mask3);
      __m128i codes = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(top, 4)), bias);
      scaled_i8(codes, _mm256_set1_ps(s.a[8 * h + 2 * k + i]), v + 2 * i);
    }
  }
};

// `count` blocks from `src` into `dst` (the tile decoder of the prefill path).
template <class D>
void run(const uint8_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i, src += D::kBytes, dst += D::kValues) {
    const typename D::State state(src);
    for (int p = 0; p < D::kParts; ++p) {
      Part v;
      D::part(src, state, p, v);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + 32 * p + 8 * j, v[j]);
    }
  }
}

// `rows` activation rows interleaved per 8 inputs, the layout dot_rows reads: the 8 floats of
// inputs 8c..8c+7 of row t at packed[(c * rows + t) * 8] (one base plus a constant a load).
inline void interleave(const float* x, int64_t stride, int64_t rows, int64_t in, float* packed) {
  for (int64_t c = 0; c < in / 8; ++c) {
    for (int64_t t = 0; t < rows; ++t) {
      _mm256_storeu_ps(packed + (c * rows + t) * 8, _mm256_loadu_ps(x + t * stride + 8 * c));
    }
  }
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// y[t, r] = W[r] . x[t] for `Rows` interleaved activation rows and output rows [first, last):
// each part decoded once into registers, then one FMA per register and row; few rows keep
// several sums a row, so that enough FMAs are independent to hide their latency.
template <class D, int Rows>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t in, const float* packed,
              int64_t first, int64_t last, float* y, int64_t out) {
  constexpr int kSums = Rows == 1 ? 4 : Rows == 2 ? 2 : 1;
  const int64_t blocks = in / D::kValues;
  for (int64_t r = first; r < last; ++r) {
    __m256 acc[Rows][kSums];
    for (int t = 0; t < Rows; ++t) {
      for (int s = 0; s < kSums; ++s) acc[t][s] = _mm256_setzero_ps();
    }
    const uint8_t* block = w + r * row_bytes;
    const float* xp = packed;
    for (int64_t b = 0; b < blocks; ++b, block += D::kBytes) {
      const typename D::State state(block);
      for (int p = 0; p < D::kParts; ++p, xp += 32 * Rows) {
        Part v;
        D::part(block, state, p, v);
        for (int j = 0; j < 4; ++j) {
          for (int t = 0; t < Rows; ++t) {
            __m256& sum = acc[t][j % kSums];
            sum = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(xp + 8 * (j * Rows + t)), sum);
          }
        }
      }
    }
    for (int t = 0; t < Rows; ++t) {
      __m256 sum = acc[t][0];
      for (int s = 1; s < kSums; ++s) sum = _mm256_add_ps(sum, acc[t][s]);
      y[t * out + r] = sum_lanes(sum);
    }
  }
}

}  // namespace prefixcache::gguf::simd
#endif
