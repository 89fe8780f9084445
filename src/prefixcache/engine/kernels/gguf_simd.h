// AVX-512 decoders for the GGUF types Gemma/Llama Q4_K_M files use most (Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): 32 values at a time into two registers, the same values as
// gguf_blocks.h (each `a * q` exact, then one rounding for `- m`/`+ m`). Compiled only where
// -march=native has AVX-512 F/BW/VL; gguf_matmul.cpp otherwise uses gguf_blocks.h alone.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREFIXCACHE_GGUF_AVX512 1
#include <immintrin.h>

#include "gguf_blocks.h"

namespace prefixcache::gguf::simd {

inline __m512 widen_i8(__m128i bytes) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)); }
inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i low_nibbles(__m128i v) { return _mm_and_si128(v, _mm_set1_epi8(15)); }
inline __m128i high_nibbles(__m128i v) { return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(15)); }

// 4- and 5-bit codes become values by table lookup: the 16 (32) values a block's codes can
// take, computed once per block or sub-block with the reference's arithmetic, then one
// permute per 16 weights instead of a conversion and a multiply.
inline __m512 iota16(float start) {
  return _mm512_add_ps(_mm512_set1_ps(start), _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}
inline __m512 lookup16(__m512 table, __m128i codes) {
  return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(codes), table);
}
inline __m512 lookup32(__m512 low, __m512 high, __m128i codes) {
  return _mm512_permutex2var_ps(low, _mm512_cvtepu8_epi32(codes), high);
}

// Each decoder: `kParts` groups of 32 values per block; `State(b)` is what a block's parts
// share (its scales), part(b, state, p, lo, hi) gives values 32p..32p+15 in `lo` and
// 32p+16..32p+31 in `hi`. The states (NoState, K4Scales, K6Scales) are in gguf_blocks.h.
struct Q8_0 {
  static constexpr int64_t kValues = 32, kBytes = 34, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(detail::half_at(b));
    lo = _mm512_mul_ps(widen_i8(load16(b + 2)), d);
    hi = _mm512_mul_ps(widen_i8(load16(b + 18)), d);
  }
};

struct Q4_0 {
  static constexpr int64_t kValues = 32, kBytes = 18, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, __m512& lo, __m512& hi) {
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(detail::half_at(b)), iota16(-8));  // d (q - 8)
    const __m128i q = load16(b + 2);
    lo = lookup16(table, low_nibbles(q));
    hi = lookup16(table, high_nibbles(q));
  }
};

struct Q4_1 {
  static constexpr int64_t kValues = 32, kBytes = 20, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(detail::half_at(b)), m = _mm512_set1_ps(detail::half_at(b + 2));
    const __m512 table = _mm512_fmadd_ps(d, iota16(0), m);  // d q + m
    const __m128i q = load16(b + 4);
    lo = lookup16(table, low_nibbles(q));
    hi = lookup16(table, high_nibbles(q));
  }
};

// Q5_0/Q5_1: the nibbles plus 16 where bit j of qh is set.
inline void five_bits(const uint8_t* qs, uint32_t qh, __m128i& lo, __m128i& hi) {
  const __m128i q = load16(qs), sixteen = _mm_set1_epi8(16);
  lo = _mm_mask_add_epi8(low_nibbles(q), static_cast<__mmask16>(qh), low_nibbles(q), sixteen);
  hi = _mm_mask_add_epi8(high_nibbles(q), static_cast<__mmask16>(qh >> 16), high_nibbles(q), sixteen);
}

struct Q5_0 {
  static constexpr int64_t kValues = 32, kBytes = 22, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(detail::half_at(b));
    const __m512 low = _mm512_mul_ps(d, iota16(-16)), high = _mm512_mul_ps(d, iota16(0));  // d (q - 16)
    __m128i l, h;
    five_bits(b + 6, detail::u32_at(b + 2), l, h);
    lo = lookup32(low, high, l);
    hi = lookup32(low, high, h);
  }
};

struct Q5_1 {
  static constexpr int64_t kValues = 32, kBytes = 24, kParts = 1;
  using State = NoState;
  static void part(const uint8_t* b, const State&, int, __m512& lo, __m512& hi) {
    const __m512 d = _mm512_set1_ps(detail::half_at(b)), m = _mm512_set1_ps(detail::half_at(b + 2));
    const __m512 low = _mm512_fmadd_ps(d, iota16(0), m), high = _mm512_fmadd_ps(d, iota16(16), m);
    __m128i l, h;
    five_bits(b + 8, detail::u32_at(b + 4), l, h);
    lo = lookup32(low, high, l);
    hi = lookup32(low, high, h);
  }
};

// Q4_K/Q5_K: sub-block p's codes (nibble p % 2 of the 32 bytes at 32 (p / 2)), scale, min.
inline void k4_codes(const uint8_t* qs, int p, __m128i& lo, __m128i& hi) {
  const uint8_t* q = qs + 32 * (p / 2);
  if (p % 2 == 0) {
    lo = low_nibbles(load16(q));
    hi = low_nibbles(load16(q + 16));
  } else {
    lo = high_nibbles(load16(q));
    hi = high_nibbles(load16(q + 16));
  }
}


struct Q4_K {
  static constexpr int64_t kValues = 256, kBytes = 144, kParts = 8;
  using State = K4Scales;
  static void part(const uint8_t* b, const State& s, int p, __m512& lo, __m512& hi) {
    const __m512 a = _mm512_set1_ps(s.a[p]), m = _mm512_set1_ps(s.m[p]);
    const __m512 table = _mm512_fmsub_ps(a, iota16(0), m);  // a q - m
    __m128i l, h;
    k4_codes(b + 16, p, l, h);
    lo = lookup16(table, l);
    hi = lookup16(table, h);
  }
};

struct Q5_K {
  static constexpr int64_t kValues = 256, kBytes = 176, kParts = 8;
  using State = K4Scales;
  static void part(const uint8_t* b, const State& s, int p, __m512& lo, __m512& hi) {
    const __m512 a = _mm512_set1_ps(s.a[p]), m = _mm512_set1_ps(s.m[p]);
    __m128i l, h;
    k4_codes(b + 48, p, l, h);
    const __m128i bit = _mm_set1_epi8(static_cast<char>(1 << p)), sixteen = _mm_set1_epi8(16);
    l = _mm_mask_add_epi8(l, _mm_test_epi8_mask(load16(b + 16), bit), l, sixteen);
    h = _mm_mask_add_epi8(h, _mm_test_epi8_mask(load16(b + 32), bit), h, sixteen);
    lo = lookup32(_mm512_fmsub_ps(a, iota16(0), m), _mm512_fmsub_ps(a, iota16(16), m), l);
    hi = lookup32(_mm512_fmsub_ps(a, iota16(0), m), _mm512_fmsub_ps(a, iota16(16), m), h);
  }
};


struct Q6_K {
  static constexpr int64_t kValues = 256, kBytes = 210, kParts = 8;
  using State = K6Scales;
  static void part(const uint8_t* b, const State& s, int p, __m512& lo, __m512& hi) {
    const int h = p / 4, k = p % 4;
    const uint8_t* low = b + 64 * h + 32 * (k % 2);
    const uint8_t* high = b + 128 + 32 * h;
    const __m128i mask3 = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    __m128i codes[2];
    for (int i = 0; i < 2; ++i) {
      __m128i l = k < 2 ? low_nibbles(load16(low + 16 * i)) : high_nibbles(load16(low + 16 * i));
      __m128i top = _mm_and_si128(_mm_srl_epi16(load16(high + 16 * i), _mm_cvtsi32_si128(2 * k)), mask3);
      codes[i] = _mm_sub_epi8(_mm_or_si128(l, _mm_slli_epi16(top, 4)), bias);
    }
    lo = _mm512_mul_ps(_mm512_set1_ps(s.a[8 * h + 2 * k]), widen_i8(codes[0]));
    hi = _mm512_mul_ps(_mm512_set1_ps(s.a[8 * h + 2 * k + 1]), widen_i8(codes[1]));
  }
};

// `count` blocks from `src` into `dst` (the tile decoder of the prefill path).
template <class D>
void run(const uint8_t* src, int64_t count, float* dst) {
  for (int64_t i = 0; i < count; ++i, src += D::kBytes, dst += D::kValues) {
    const typename D::State state(src);
    for (int p = 0; p < D::kParts; ++p) {
      __m512 lo, hi;
      D::part(src, state, p, lo, hi);
      _mm512_storeu_ps(dst + 32 * p, lo);
      _mm512_storeu_ps(dst + 32 * p + 16, hi);
    }
  }
}

// `rows` activation rows of `in` floats (`stride` apart) interleaved per 16 inputs, the layout
// dot_rows reads: the 16 floats of inputs 16c..16c+15 of row t at packed[(c * rows + t) * 16].
// Each load is then one base plus a constant (with 16 rows in their own layout the kernel ran
// out of address registers, and rows a multiple of 4 KiB apart share L1 sets).
template <class D>
constexpr bool kCopiesOneRow = false;  // one row is read as it is

template <class D>
void interleave(const float* x, int64_t stride, int64_t rows, int64_t in, float* packed) {
  for (int64_t c = 0; c < in / 16; ++c) {
    for (int64_t t = 0; t < rows; ++t) {
      _mm512_storeu_ps(packed + (c * rows + t) * 16, _mm512_loadu_ps(x + t * stride + 16 * c));
    }
  }
}

// y[t, r] = W[r] . x[t] for `Rows` interleaved activation rows and output rows [first, last):
// each part decoded once into registers, then one FMA per row (two sums a row up to 4 rows,
// for the FMA latency; one above, where the rows give enough independent sums).
template <class D, int Rows>
void dot_each_row(const uint8_t* w, int64_t row_bytes, int64_t in, const float* packed,
                  int64_t first, int64_t last, float* y, int64_t out) {
  constexpr int kSums = Rows <= 4 ? 2 : 1;
  const int64_t blocks = in / D::kValues;
  for (int64_t r = first; r < last; ++r) {
    __m512 acc[Rows][kSums];
    for (int t = 0; t < Rows; ++t) {
      for (int s = 0; s < kSums; ++s) acc[t][s] = _mm512_setzero_ps();
    }
    const uint8_t* block = w + r * row_bytes;
    const float* xp = packed;
    for (int64_t b = 0; b < blocks; ++b, block += D::kBytes) {
      prefetch_ahead<D::kBytes>(block);
      const typename D::State state(block);
      for (int p = 0; p < D::kParts; ++p, xp += 32 * Rows) {
        __m512 lo, hi;
        D::part(block, state, p, lo, hi);
        for (int t = 0; t < Rows; ++t) {
          acc[t][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp + 16 * t), acc[t][0]);
          acc[t][kSums - 1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp + 16 * (Rows + t)), acc[t][kSums - 1]);
        }
      }
    }
    for (int t = 0; t < Rows; ++t) {
      __m512 sum = kSums == 2 ? _mm512_add_ps(acc[t][0], acc[t][kSums - 1]) : acc[t][0];
      y[t * out + r] = _mm512_reduce_add_ps(sum);
    }
  }
}

// dot_each_row, but two output rows at a time from 4 activation rows up: each activation
// load feeds two FMAs (one load an FMA kept the 8-row kernel at about one FMA a cycle, the
// activations of a 2,048-wide matrix coming from L2); an odd last row goes alone.
template <class D, int Rows>
void dot_rows(const uint8_t* w, int64_t row_bytes, int64_t in, const float* packed,
              int64_t first, int64_t last, float* y, int64_t out) {
  if constexpr (Rows < 4) {
    dot_each_row<D, Rows>(w, row_bytes, in, packed, first, last, y, out);
  } else {
    const int64_t blocks = in / D::kValues;
    int64_t r = first;
    for (; r + 1 < last; r += 2) {
      __m512 acc0[Rows], acc1[Rows];
      for (int t = 0; t < Rows; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
      const uint8_t* b0 = w + r * row_bytes;
      const uint8_t* b1 = b0 + row_bytes;
      const float* xp = packed;
      for (int64_t b = 0; b < blocks; ++b, b0 += D::kBytes, b1 += D::kBytes) {
        prefetch_ahead<D::kBytes>(b0);
        prefetch_ahead<D::kBytes>(b1);
        const typename D::State s0(b0), s1(b1);
        for (int p = 0; p < D::kParts; ++p, xp += 32 * Rows) {
          __m512 lo0, hi0, lo1, hi1;
          D::part(b0, s0, p, lo0, hi0);
          D::part(b1, s1, p, lo1, hi1);
          for (int t = 0; t < Rows; ++t) {
            const __m512 xl = _mm512_loadu_ps(xp + 16 * t), xh = _mm512_loadu_ps(xp + 16 * (Rows + t));
            acc0[t] = _mm512_fmadd_ps(hi0, xh, _mm512_fmadd_ps(lo0, xl, acc0[t]));
            acc1[t] = _mm512_fmadd_ps(hi1, xh, _mm512_fmadd_ps(lo1, xl, acc1[t]));
          }
        }
      }
      for (int t = 0; t < Rows; ++t) {
        y[t * out + r] = _mm512_reduce_add_ps(acc0[t]);
        y[t * out + r + 1] = _mm512_reduce_add_ps(acc1[t]);
      }
    }
    if (r < last) dot_each_row<D, Rows>(w, row_bytes, in, packed, r, last, y, out);
  }
}

}  // namespace prefixcache::gguf::simd
#endif
