// GGUF weight blocks decoded to fp32, bit for bit as gguf-py's `gguf.quants.dequantize`.
//
// Every quantized value is `a * q + b` with `a * q` exact in fp32 (a: an fp16 scale times a
// small integer, q: at most 6 bits), so the one rounding is the `+ b`, whether or not the
// compiler fuses it: the loops below give the reference's bits with or without FMA. Plain
// loops with fixed trip counts, which -O3 -march=native vectorizes (AVX-512 here, whatever the
// CPU has elsewhere).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace prefixcache::gguf {

// gguf.GGMLQuantizationType values.
enum Type : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

// Decodes `blocks` consecutive blocks from `src` into `blocks * values` floats at `dst`.
using DecodeRun = void (*)(const uint8_t* src, int64_t blocks, float* dst);

struct Format {
  int64_t values;  // weights per block
  int64_t bytes;   // bytes per block
  DecodeRun decode;
};

namespace detail {

// An fp16 at `p` as fp32 (exact): the F16C instruction where the CPU has it.
inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Q4_K/Q5_K: sub-block j's 6-bit scale and minimum from the 12 packed bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& scale, int& min) {
  if (j < 4) {
    scale = s[j] & 63;
    min = s[j + 4] & 63;
  } else {
    scale = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
    min = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q3_K: group i's signed 6-bit scale.
inline int scale_k3(const uint8_t* s, int i) {
  int low = i < 8 ? s[i] & 15 : s[i - 8] >> 4;
  int high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
  return (low | (high << 4)) - 32;
}

}  // namespace detail

// One block of each type: `b` its bytes, `y` its values.
inline void decode_q4_0(const uint8_t* b, float* y) {
  const float d = detail::half_at(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((qs[j] & 15) - 8);
    y[j + 16] = d * static_cast<float>((qs[j] >> 4) - 8);
  }
}

inline void decode_q4_1(const uint8_t* b, float* y) {
  const float d = detail::half_at(b), m = detail::half_at(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(qs[j] & 15) + m;
    y[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

inline void decode_q5_0(const uint8_t* b, float* y) {
  const float d = detail::half_at(b);
  const uint32_t qh = detail::u32_at(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo - 16);
    y[j + 16] = d * static_cast<float>(hi - 16);
  }
}

inline void decode_q5_1(const uint8_t* b, float* y) {
  const float d = detail::half_at(b), m = detail::half_at(b + 2);
  const uint32_t qh = detail::u32_at(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    int lo = (qs[j] & 15) | (((qh >> j) & 1) << 4), hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
    y[j] = d * static_cast<float>(lo) + m;
    y[j + 16] = d * static_cast<float>(hi) + m;
  }
}

inline void decode_q8_0(const uint8_t* b, float* y) {
  const float d = detail::half_at(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(qs[j]) * d;
}

// Q2_K: 16 scale bytes (low nibble: scale, high: min), 64 code bytes, d, dmin.
inline void decode_q2_k(const uint8_t* b, float* y) {
  const uint8_t *sc = b, *qs = b + 16;
  const float d = detail::half_at(b + 80), dmin = detail::half_at(b + 82);
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {
      for (int half = 0; half < 2; ++half) {
        int g = 8 * h + 2 * k + half;
        const float a = d * static_cast<float>(sc[g] & 15), m = dmin * static_cast<float>(sc[g] >> 4);
        float* out = y + 16 * g;
        const uint8_t* q = qs + 32 * h + 16 * half;
        for (int l = 0; l < 16; ++l) out[l] = a * static_cast<float>((q[l] >> (2 * k)) & 3) - m;
      }
    }
  }
}

// Q3_K: 32 high-bit mask bytes, 64 code bytes, 12 packed scale bytes, d.
inline void decode_q3_k(const uint8_t* b, float* y) {
  const uint8_t *hmask = b, *qs = b + 32, *sc = b + 96;
  const float d = detail::half_at(b + 108);
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {
      int row = 4 * h + k;  // 32 values: hmask bit `row`, code bits 2k of qs[32h + l]
      for (int half = 0; half < 2; ++half) {
        int g = 2 * row + half;
        const float a = d * static_cast<float>(detail::scale_k3(sc, g));
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          int q = ((qs[32 * h + l] >> (2 * k)) & 3) - (((hmask[l] >> row) & 1) ? 0 : 4);
          y[32 * row + l] = a * static_cast<float>(q);
        }
      }
    }
  }
}

// Q4_K: d, dmin, 12 packed scale bytes, 128 code bytes (64 values per 32 bytes: low, high).
inline void decode_q4_k(const uint8_t* b, float* y) {
  const float d = detail::half_at(b), dmin = detail::half_at(b + 2);
  const uint8_t *sc = b + 4, *qs = b + 16;
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    detail::scale_min_k4(sc, j, scale, min);
    const float a = d * static_cast<float>(scale), m = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) y[32 * j + l] = a * static_cast<float>((q[l] >> shift) & 15) - m;
  }
}

// Q5_K: Q4_K's layout with 32 high-bit bytes (bit j of byte l: sub-block j) before the codes.
inline void decode_q5_k(const uint8_t* b, float* y) {
  const float d = detail::half_at(b), dmin = detail::half_at(b + 2);
  const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + 48;
  for (int j = 0; j < 8; ++j) {
    int scale, min;
    detail::scale_min_k4(sc, j, scale, min);
    const float a = d * static_cast<float>(scale), m = dmin * static_cast<float>(min);
    const uint8_t* q = qs + 32 * (j / 2);
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) {
      int v = ((q[l] >> shift) & 15) | (((qh[l] >> j) & 1) << 4);
      y[32 * j + l] = a * static_cast<float>(v) - m;
    }
  }
}

// Q6_K: 128 low-nibble bytes, 64 high-2-bit bytes, 16 int8 scales, d.
inline void decode_q6_k(const uint8_t* b, float* y) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = detail::half_at(b + 208);
  for (int h = 0; h < 2; ++h) {
    for (int k = 0; k < 4; ++k) {  // 32 values: nibble k / 2 of ql[64h + 32 (k % 2) + l]
      const uint8_t* low = ql + 64 * h + 32 * (k % 2);
      const int shift = 4 * (k / 2);
      for (int half = 0; half < 2; ++half) {
        int g = 8 * h + 2 * k + half;
        const float a = d * static_cast<float>(sc[g]);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          int q = (((low[l] >> shift) & 15) | (((qh[32 * h + l] >> (2 * k)) & 3) << 4)) - 32;
          y[128 * h + 32 * k + l] = a * static_cast<float>(q);
        }
      }
    }
  }
}

// The decode kernels read each matrix once, block after block, and decode faster than the
// hardware prefetcher alone fetches on some machines: on a 2-core KVM Xeon with AMX, a
// Q4_1 matrix streamed at 2.3 GB/s a core (8.2 from cache) without this and 6.4 with it
// (docs/benchmarks.md). So each block asks for the lines `kPrefetchAhead` bytes on (past a
// matrix's end a prefetch is a no-op: it never faults).
constexpr int64_t kPrefetchAhead = 2048;

template <int64_t Bytes>
inline void prefetch_ahead(const uint8_t* block) {
  for (int64_t offset = 0; offset < Bytes; offset += 64) {
    __builtin_prefetch(block + kPrefetchAhead + offset, 0, 3);
  }
}

// What the SIMD decoders (gguf_simd*.h) compute once per block for all its parts.
struct NoState {
  explicit NoState(const uint8_t*) {}
};

// Q4_K/Q5_K: the 8 sub-blocks' `d * scale` and `dmin * min`, once per block.
struct K4Scales {
  float a[8], m[8];
  explicit K4Scales(const uint8_t* b) {
    const float d = detail::half_at(b), dmin = detail::half_at(b + 2);
    for (int j = 0; j < 8; ++j) {
      int scale, min;
      detail::scale_min_k4(b + 4, j, scale, min);
      a[j] = d * static_cast<float>(scale);
      m[j] = dmin * static_cast<float>(min);
    }
  }
};

// Q6_K: the block's 16 `d * scale`, once per block.
struct K6Scales {
  float a[16];
  explicit K6Scales(const uint8_t* b) {
    const float d = detail::half_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int g = 0; g < 16; ++g) a[g] = d * static_cast<float>(sc[g]);
  }
};

}  // namespace prefixcache::gguf
