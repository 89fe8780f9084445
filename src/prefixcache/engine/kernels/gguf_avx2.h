// The AVX2 helpers both AVX2 kernels use: the fp32 decoders (gguf_simd_avx2.h, CPUs without
// AVX-512) and the int8-activation kernel (gguf_int8.h, every CPU with AVX2).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace prefixcache::gguf::avx2 {

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// The sum of a register's 8 floats.
inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

}  // namespace prefixcache::gguf::avx2
#endif
