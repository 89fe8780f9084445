// AVX2 + FMA decoders for CPUs without AVX-512 (AMD Zen 2/3, older Intel): gguf_simd.h's
// interface with 8 lanes. A part's 32 values land in four registers, the same values as
// gguf_blocks.h (each `a * q` exact, then one rounding for `- m`/`+ m`, so FMA or not gives the
// reference's bits). Codes become floats by conversion, not lookup: AVX2 has no 16-entry
// permute. Each decoder says how its values sit in the registers (`kByLane`, below), and the
// activations are laid out the same way (`interleave<D>`).
#pragma once

#if defined(__AVX2__) && defined(__FMA__) && !defined(PREFIXCACHE_GGUF_AVX512)
#define PREFIXCACHE_GGUF_AVX2 1
#include <immintrin.h>

#include "gguf_avx2.h"
#include "gguf_blocks.h"

namespace prefixcache::gguf::simd {

using Part = __m256[4];  // one part's 32 values, lane i of v[k] = value 4i + k (see above)

// Codes come out of the block's bytes by shifts and masks within 32-bit lanes, never by
// byte shuffles (AVX2's widening converts all share one port, which bound the kernel): lane i
// holds bytes 4i..4i+3, so a shift by 8k leaves value 4i + k in lane i. The nibble types load
// their 16 bytes into both halves: the high half's lanes take the high nibbles (values 16+).
using avx2::load32;
inline __m256i load16_twice(const uint8_t* p) {
  return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i every_lane(int value) { return _mm256_set1_epi32(value); }
// Nibble codes from bytes loaded twice: the low nibble of byte k of each lane in the low half,
// the high nibble in the high half.
template <int K>
inline __m256i nibbles(__m256i v) {
  constexpr int low = 8 * K, high = 8 * K + 4;
  const __m256i shift = _mm256_setr_epi32(low, low, low, low, high, high, high, high);
  return _mm256_and_si256(_mm256_srlv_epi32(v, shift), every_lane(15));
}
inline __m256 to_float(__m256i v) { return _mm256_cvtepi32_ps(v); }

// The four registers of 32 nibble codes (low half: nibble of byte 4i+k, high half: the high one).
inline void nibble_codes(__m256i bytes, __m256i* q) {
  q[0] = nibbles<0>(bytes);
  q[1] = nibbles<1>(bytes);
  q[2] = nibbles<2>(bytes);
  q[3] = nibbles<3>(bytes);
}

// 16 where bit 4i+k (+16 in the high half) of `qh` is set: Q5_0/Q5_1's fifth bits.
inline void fifth_bits(uint32_t qh, __m256i* q) {
  const int low = static_cast<int>(qh << 4), high = static_cast<int>(qh >> 12);
  const __m256i bits = _mm256_setr_epi32(low, low, low, low, high, high, high, high);
  const __m256i four = _mm256_setr_epi32(0, 4, 8, 12, 0, 4, 8, 12);
  for (int k = 0; k < 4; ++k) {
    const __m256i shift = _mm256_add_epi32(four, _mm256_set1_epi32(k));
    q[k] = _mm256_or_si256(q[k], _mm256_and_si256(_mm256_srlv_epi32(bits, shift), every_lane(16)));
  }
}

// a (q - offset) for four registers of codes: one rounding, and -0 where a < 0 and q = offset,
// as the reference's product (a fused a q - a offset would give +0 there).
inline void scaled(const __m256i* q, int offset, __m256 a, Part& v) {
  for (int k = 0; k < 4; ++k) v[k] = _mm256_mul_ps(a, to_float(_mm256_sub_epi32(q[k], every_lane(offset))));
}

// a q + m for four registers of codes (each a q exact, one rounding for + m).
inline void affine(const __m256i* q, __m256 a, __m256 m, Part& v) {
  for (int k = 0; k < 4; ++k) v[k] = _mm256_fmadd_ps(a, to_float(q[k]), m);
}

struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18, kParts = 1;
  static constexpr bool kByLane = true;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    __m256i q[4];
    nibble_codes(load16_twice(b + 2), q);
    scaled(q, 8, _mm256_set1_ps(detail::half_at(b)), v);
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20, kParts = 1;
  static constexpr bool kByLane = true;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    __m256i q[4];
    nibble_codes(load16_twice(b + 4), q);
    affine(q, _mm256_set1_ps(detail::half_at(b)), _mm256_set1_ps(detail::half_at(b + 2)), v);
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24, kParts = 1;
  static constexpr bool kByLane = true;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    __m256i q[4];
    nibble_codes(load16_twice(b + 8), q);
    fifth_bits(detail::u32_at(b + 4), q);
    affine(q, _mm256_set1_ps(detail::half_at(b)), _mm256_set1_ps(detail::half_at(b + 2)), v);
  }
};

// Q4_K/Q5_K: sub-block p's codes, nibble p % 2 of the 32 bytes at 32 (p / 2) (value j: byte j).
inline void k4_codes(const uint8_t* qs, int p, __m256i* q) {
  const __m256i bytes = _mm256_srl_epi32(load32(qs + 32 * (p / 2)), _mm_cvtsi32_si128(4 * (p % 2)));
  q[0] = _mm256_and_si256(bytes, every_lane(15));
  q[1] = _mm256_and_si256(_mm256_srli_epi32(bytes, 8), every_lane(15));
  q[2] = _mm256_and_si256(_mm256_srli_epi32(bytes, 16), every_lane(15));
  q[3] = _mm256_and_si256(_mm256_srli_epi32(bytes, 24), every_lane(15));
}

struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144, kParts = 8;
  static constexpr bool kByLane = true;
  using State = K4Scales;
  static void part(const uint8_t* b, const State& s, int p, Part& v) {
    __m256i q[4];
    k4_codes(b + 16, p, q);
    affine(q, _mm256_set1_ps(s.a[p]), _mm256_set1_ps(-s.m[p]), v);  // a q - m
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176, kParts = 8;
  static constexpr bool kByLane = true;
  using State = K4Scales;
  static void part(const uint8_t* b, const State& s, int p, Part& v) {
    __m256i q[4];
    k4_codes(b + 48, p, q);
    // bit p of qh byte j is value j's fifth bit: moved to bit 4 of byte k of each lane
    const __m256i qh = load32(b + 16);
    const __m256i top = p >= 4 ? _mm256_srl_epi32(qh, _mm_cvtsi32_si128(p - 4))
                               : _mm256_sll_epi32(qh, _mm_cvtsi32_si128(4 - p));
    q[0] = _mm256_or_si256(q[0], _mm256_and_si256(top, every_lane(16)));
    q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_srli_epi32(top, 8), every_lane(16)));
    q[2] = _mm256_or_si256(q[2], _mm256_and_si256(_mm256_srli_epi32(top, 16), every_lane(16)));
    q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_srli_epi32(top, 24), every_lane(16)));
    affine(q, _mm256_set1_ps(s.a[p]), _mm256_set1_ps(-s.m[p]), v);
  }
};

// Natural order (v[j] = values 8j..8j+7), for the decoders whose codes are whole bytes (Q8_0)
// or need byte shuffles anyway (Q5_0's fifth bits, Q6_K's two planes): `kByLane = false`.
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(15)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)); }

// 16 signed byte codes times `a` into two registers.
inline void scaled_i8(__m128i codes, __m256 a, __m256* v) {
  v[0] = _mm256_mul_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)));
  v[1] = _mm256_mul_ps(a, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(codes, 8))));
}

// 16 where bit j of `bits` (16 of them) is set, for byte j; 0 elsewhere.
inline __m128i sixteen_where(uint32_t bits) {
  const __m128i spread = _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  const __m128i bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  const __m128i bytes = _mm_shuffle_epi8(_mm_cvtsi32_si128(static_cast<int>(bits)), spread);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(bytes, bit), bit), _mm_set1_epi8(16));
}

// Q5_0/Q5_1: the nibbles plus 16 where bit j of qh is set.
inline void five_bits(const uint8_t* qs, uint32_t qh, __m128i& lo, __m128i& hi) {
  const __m128i q = load16(qs);
  lo = _mm_or_si128(low_nibbles(q), sixteen_where(qh & 0xFFFF));
  hi = _mm_or_si128(high_nibbles(q), sixteen_where(qh >> 16));
}

struct Q8_0 {  // natural order: each 8 codes widened straight from memory (no shuffle)
  static constexpr int64_t kValues = 32, kBytes = 34, kParts = 1;
  static constexpr bool kByLane = false;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, Part& v) {
    const __m256 d = _mm256_set1_ps(detail::half_at(b));
    for (int j = 0; j < 4; ++j) {
      const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + 2 + 8 * j));
      v[j] = _mm256_mul_ps(d, to_float(_mm256_cvtepi8_epi32(codes)));
    }
  }
};

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22, kParts = 1;
  static constexpr bool kByLane = false;
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

struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210, kParts = 8;
  static constexpr bool kByLane = false;
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

// The 32 values of `v` in their own order (value 4i + k from lane i of v[k]) into `dst`.
inline void store_in_order(const Part& v, float* dst) {
  const __m256 t0 = _mm256_unpacklo_ps(v[0], v[1]), t1 = _mm256_unpackhi_ps(v[0], v[1]);
  const __m256 t2 = _mm256_unpacklo_ps(v[2], v[3]), t3 = _mm256_unpackhi_ps(v[2], v[3]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u1, 0x20));
  _mm256_storeu_ps(dst + 8, _mm256_permute2f128_ps(u2, u3, 0x20));
  _mm256_storeu_ps(dst + 16, _mm256_permute2f128_ps(u0, u1, 0x31));
  _mm256_storeu_ps(dst + 24, _mm256_permute2f128_ps(u2, u3, 0x31));
}

// `count` blocks from `src` into `dst` (the tile decoder of the prefill path).
template <class D>
void run(const uint8_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i, src += D::kBytes, dst += D::kValues) {
    const typename D::State state(src);
    for (int p = 0; p < D::kParts; ++p) {
      Part v;
      D::part(src, state, p, v);
      if constexpr (D::kByLane) {
        store_in_order(v, dst + 32 * p);
      } else {
        for (int j = 0; j < 4; ++j) _mm256_storeu_ps(dst + 32 * p + 8 * j, v[j]);
      }
    }
  }
}

// `rows` activation rows in the order D's dot_rows reads them, register c of row t at
// packed[(c * rows + t) * 8] (one base plus a constant a load): per 32 inputs, register k
// holds inputs 8k..8k+7, or with `kByLane` inputs 4i + k (lane i), as D's weights sit. A
// by-lane decoder's one row is copied too (`kCopiesOneRow`); a natural one reads x itself.
template <class D>
constexpr bool kCopiesOneRow = D::kByLane;

template <class D>
void interleave(const float* x, int64_t stride, int64_t rows, int64_t in, float* packed) {
  for (int64_t c = 0; c < in / 8; ++c) {
    const int64_t group = c / 4, k = c % 4;
    for (int64_t t = 0; t < rows; ++t) {
      const float* src = x + t * stride + 32 * group;
      float* dst = packed + (c * rows + t) * 8;
      if constexpr (D::kByLane) {
        for (int i = 0; i < 8; ++i) dst[i] = src[4 * i + k];
      } else {
        _mm256_storeu_ps(dst, _mm256_loadu_ps(src + 8 * k));
      }
    }
  }
}

using avx2::sum_lanes;

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
      prefetch_ahead<D::kBytes>(block);
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
