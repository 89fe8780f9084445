// torch.ops.prefixcache.gguf_dequantize / gguf_matmul: matrices kept in a GGUF's own blocks
// (weight_types.PackedWeight), `[out, row bytes]` uint8, decoded on the fly.
//
// Numerical contract of gguf_matmul: each weight takes exactly its dequantized fp32 value
// (gguf_blocks.h); activations stay fp32; products and sums are fp32 (FMA), in an order that
// differs from a dense matmul's. So it equals `x @ dequantize().T` up to fp32 summation order:
// |error| <= in * 2^-24 * sum_i |w_i x_i| (the usual bound of an fp32 dot product).
//   - Few rows (decode, up to the caller's `limits.decode`): parallel over output rows, 8
//     activation rows a pass; with AVX-512 (AVX2) each 32 weights are decoded into two (four)
//     registers and multiplied into every row (gguf_simd.h, gguf_simd_avx2.h), elsewhere 256
//     values at a time are decoded into a buffer that stays in L1 and dotted with every row.
//   - Middle rows (a step of decodes and prompt chunks, up to `limits.panel`): gguf_panel.h,
//     each weight decoded once into a panel of a few output rows that stays in cache and
//     multiplied into all the rows by a register-blocked kernel (AVX2 or AVX-512 builds).
//   - Many rows (prefill): the matrix decoded into fp32 (whole, or for a very large one tile
//     by tile, in parallel) and multiplied by sgemm (at::mm).
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <array>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_int8.h"
#include "gguf_matmul.h"
#include "gguf_panel.h"
#include "gguf_simd.h"
#include "gguf_simd_avx2.h"

#if defined(PREFIXCACHE_GGUF_AVX512) || defined(PREFIXCACHE_GGUF_AVX2)
#define PREFIXCACHE_GGUF_SIMD 1
#endif

namespace prefixcache::gguf {

namespace {

template <void (*Block)(const uint8_t*, float*), int64_t Values, int64_t Bytes>
void run(const uint8_t* src, int64_t blocks, float* dst) {
  for (int64_t i = 0; i < blocks; ++i) Block(src + i * Bytes, dst + i * Values);
}

void run_f32(const uint8_t* src, int64_t n, float* dst) { std::memcpy(dst, src, n * 4); }

void run_f16(const uint8_t* src, int64_t n, float* dst) {
  const c10::Half* h = reinterpret_cast<const c10::Half*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(h[i]);
}

void run_bf16(const uint8_t* src, int64_t n, float* dst) {
  const uint16_t* h = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(h[i]) << 16;
}

constexpr int64_t kMaxRows = 8;  // activation rows the decode kernel takes per pass
// Rows up to which int16 activations take the integer kernel: past two, the fp32 decode kernel
// is faster (its extra row costs 4 FMAs a part, the int16 kernel's ~12 ops). Through a
// SmolLM2-shaped stack, ms fp32 / int16: AVX2 1 row 6.3 / 4.2, 2 rows 6.9 / 6.2, 4 rows 8.1 /
// 9.4; AVX-512 5.9 / 4.5, 6.0 / 6.3, 7.3 / 10.5 (a 2-core KVM Xeon; docs/benchmarks.md).
constexpr int64_t kInt16Rows = 2;

// One type's decode kernel for `rows` activation rows (entry rows - 1 of its table), laid out
// by simd::interleave: y[t, r] for t < rows, r in [first, last).
using DotRows = void (*)(const uint8_t* w, int64_t row_bytes, int64_t in, const float* packed,
                         int64_t first, int64_t last, float* y, int64_t out);

// Activation rows laid out as a type's DotRows reads them (simd::interleave).
using Interleave = void (*)(const float* x, int64_t stride, int64_t rows, int64_t in, float* packed);

#ifdef PREFIXCACHE_GGUF_INT8
// One type's integer-activation decode kernel (gguf_int8.h) for `rows` rows (entry rows - 1).
using DotRowsInt8 = void (*)(const uint8_t* w, int64_t row_bytes, int64_t in,
                             const int8::Activations& x, int64_t first, int64_t last, float* y,
                             int64_t out);
template <class D, int Bits, size_t... R>
constexpr std::array<DotRowsInt8, sizeof...(R)> int8_dots_for(std::index_sequence<R...>) {
  return {int8::dot_rows<D, static_cast<int>(R) + 1, Bits>...};
}
template <class D, int Bits, int64_t Rows>
constexpr std::array<DotRowsInt8, Rows> kInt8Dots = int8_dots_for<D, Bits>(std::make_index_sequence<Rows>{});
#define INT8(T) kInt8Dots<int8::T, 8, kMaxRows>.data(), kInt8Dots<int8::T, 16, kInt16Rows>.data()
#else
using DotRowsInt8 = void*;
#define INT8(T) nullptr, nullptr
#endif

// A type's kernels: the portable decoder (gguf_blocks.h) and, where compiled, SIMD ones.
struct Kernels {
  Format portable;
  DecodeRun fast_decode;    // the same values as portable.decode
  const DotRows* dots;      // kMaxRows entries, or nullptr: decode into a buffer, then dot
  Interleave interleave;    // with dots: the rows as they read them
  bool copies_one_row;      // with dots: one row is laid out too (else read as it is)
  const DotRowsInt8* int8_dots = nullptr;   // kMaxRows entries, or nullptr: none for the type
  const DotRowsInt8* int16_dots = nullptr;  // kInt16Rows entries, with int16 activations
};

#define NO_FAST nullptr, nullptr, nullptr, false  // the portable decoder alone

#ifdef PREFIXCACHE_GGUF_SIMD
template <class D, size_t... R>
constexpr std::array<DotRows, kMaxRows> dots_for(std::index_sequence<R...>) {
  return {simd::dot_rows<D, static_cast<int>(R) + 1>...};
}
template <class D>
constexpr std::array<DotRows, kMaxRows> kDots = dots_for<D>(std::make_index_sequence<kMaxRows>{});
#define FAST(T) \
  simd::run<simd::T>, kDots<simd::T>.data(), simd::interleave<simd::T>, simd::kCopiesOneRow<simd::T>
#else
#define FAST(T) NO_FAST
#endif

#define BLOCKS(T, f, V, B) {{V, B, run<f, V, B>}, FAST(T), INT8(T)}
constexpr Kernels kF32_kernels{{1, 4, run_f32}, NO_FAST};
constexpr Kernels kF16_kernels{{1, 2, run_f16}, NO_FAST};
constexpr Kernels kBF16_kernels{{1, 2, run_bf16}, NO_FAST};
constexpr Kernels kQ4_0_kernels BLOCKS(Q4_0, decode_q4_0, 32, 18);
constexpr Kernels kQ4_1_kernels BLOCKS(Q4_1, decode_q4_1, 32, 20);
constexpr Kernels kQ5_0_kernels BLOCKS(Q5_0, decode_q5_0, 32, 22);
constexpr Kernels kQ5_1_kernels BLOCKS(Q5_1, decode_q5_1, 32, 24);
constexpr Kernels kQ8_0_kernels BLOCKS(Q8_0, decode_q8_0, 32, 34);
constexpr Kernels kQ2_K_kernels{{256, 84, run<decode_q2_k, 256, 84>}, NO_FAST};
constexpr Kernels kQ3_K_kernels{{256, 110, run<decode_q3_k, 256, 110>}, NO_FAST};
constexpr Kernels kQ4_K_kernels BLOCKS(Q4_K, decode_q4_k, 256, 144);
constexpr Kernels kQ5_K_kernels BLOCKS(Q5_K, decode_q5_k, 256, 176);
constexpr Kernels kQ6_K_kernels BLOCKS(Q6_K, decode_q6_k, 256, 210);
#undef BLOCKS
#undef INT8
#undef FAST
#undef NO_FAST

const Kernels* kernels_of(int64_t type) {
  switch (type) {
    case kF32: return &kF32_kernels;
    case kF16: return &kF16_kernels;
    case kBF16: return &kBF16_kernels;
    case kQ4_0: return &kQ4_0_kernels;
    case kQ4_1: return &kQ4_1_kernels;
    case kQ5_0: return &kQ5_0_kernels;
    case kQ5_1: return &kQ5_1_kernels;
    case kQ8_0: return &kQ8_0_kernels;
    case kQ2_K: return &kQ2_K_kernels;
    case kQ3_K: return &kQ3_K_kernels;
    case kQ4_K: return &kQ4_K_kernels;
    case kQ5_K: return &kQ5_K_kernels;
    case kQ6_K: return &kQ6_K_kernels;
    default: return nullptr;
  }
}

constexpr int64_t kChunk = 256;          // values the portable decode kernel decodes at a time
constexpr int64_t kTileBytes = 1 << 19;  // fp32 bytes of a prefill tile of weights

struct Matrix {
  const uint8_t* data;
  int64_t rows, row_bytes, in;
  const Format* f;
  const Kernels* k;

  const uint8_t* row(int64_t r) const { return data + r * row_bytes; }
  // Rows [first, first + count) into dst, with the fast decoder unless `portable`.
  void decode_rows(int64_t first, int64_t count, float* dst, bool portable = false) const {
    DecodeRun decode = portable || !k->fast_decode ? f->decode : k->fast_decode;
    for (int64_t r = 0; r < count; ++r) decode(row(first + r), in / f->values, dst + r * in);
  }
};

Matrix matrix(const at::Tensor& blocks, int64_t type, int64_t in) {
  const Kernels* k = kernels_of(type);
  TORCH_CHECK(k != nullptr, "unsupported GGML type ", type);
  const Format* f = &k->portable;
  TORCH_CHECK(in > 0 && in % f->values == 0, "in_features ", in, " is not a multiple of ", f->values);
  TORCH_CHECK(blocks.dtype() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == in / f->values * f->bytes,
              "blocks must be contiguous uint8 [out, ", in / f->values * f->bytes, "]");
  return {blocks.data_ptr<uint8_t>(), blocks.size(0), blocks.size(1), in, f, k};
}

inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y[t, r] for `t` in [0, rows) of x (`x_stride` floats apart), r in [first, last): the
// portable decode kernel, 256 values decoded at a time into a buffer that stays in L1.
void dot_rows(const Matrix& w, const float* x, int64_t x_stride, int64_t rows, int64_t first,
              int64_t last, float* y, int64_t out) {
  alignas(64) float buffer[kChunk];
  const int64_t per_chunk = std::max<int64_t>(1, kChunk / w.f->values);
  for (int64_t r = first; r < last; ++r) {
    float acc[kMaxRows] = {};
    for (int64_t b = 0, blocks = w.in / w.f->values; b < blocks; b += per_chunk) {
      int64_t count = std::min(per_chunk, blocks - b), start = b * w.f->values;
      w.f->decode(w.row(r) + b * w.f->bytes, count, buffer);
      for (int64_t t = 0; t < rows; ++t) {
        acc[t] += dot(buffer, x + t * x_stride + start, count * w.f->values);
      }
    }
    for (int64_t t = 0; t < rows; ++t) y[t * out + r] = acc[t];
  }
}

#ifdef PREFIXCACHE_GGUF_INT8
// decode_matmul with integer activations (gguf_int8.h's contract): each row quantized once.
template <int Bits>
void int8_decode_matmul(const Matrix& w, const at::Tensor& x, float* y) {
  const int64_t tokens = x.size(0), groups = w.in / 32, grain = std::max<int64_t>(1, 16384 / w.in);
  std::vector<int8_t> codes(tokens * w.in), low(Bits == 16 ? tokens * w.in : 0);
  std::vector<float> scales(tokens * groups), sums(tokens * groups);
  const float* xs = x.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    int8_t* low_row = Bits == 16 ? &low[t * w.in] : nullptr;
    int8::quantize_row<Bits>(xs + t * w.in, w.in, &codes[t * w.in], low_row, &scales[t * groups],
                             &sums[t * groups]);
  }
  const DotRowsInt8* dots = Bits == 8 ? w.k->int8_dots : w.k->int16_dots;
  for (int64_t t0 = 0; t0 < tokens; t0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, tokens - t0);
    const int8_t* low_rows = Bits == 16 ? &low[t0 * w.in] : nullptr;
    const int8::Activations a{&codes[t0 * w.in], low_rows, &scales[t0 * groups], &sums[t0 * groups], groups};
    at::parallel_for(0, w.rows, grain, [&](int64_t first, int64_t last) {
      dots[rows - 1](w.data, w.row_bytes, w.in, a, first, last, y + t0 * w.rows, w.rows);
    });
  }
}
#endif

void decode_matmul(const Matrix& w, const at::Tensor& x, float* y) {
  const int64_t tokens = x.size(0), grain = std::max<int64_t>(1, 16384 / w.in);
  const float* xs = x.data_ptr<float>();
  const bool copies = w.k->dots && (tokens > 1 || w.k->copies_one_row);
  std::vector<float> packed(copies ? std::min(tokens, kMaxRows) * w.in : 0);
  for (int64_t t0 = 0; t0 < tokens; t0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, tokens - t0);
    float* ys = y + t0 * w.rows;
    if (copies) w.k->interleave(xs + t0 * w.in, w.in, rows, w.in, packed.data());
    at::parallel_for(0, w.rows, grain, [&](int64_t first, int64_t last) {
      if (w.k->dots) {
        const float* xp = copies ? packed.data() : xs + t0 * w.in;
        w.k->dots[rows - 1](w.data, w.row_bytes, w.in, xp, first, last, ys, w.rows);
      } else {
        dot_rows(w, xs + t0 * w.in, w.in, rows, first, last, ys, w.rows);
      }
    });
  }
}

#ifdef PREFIXCACHE_GGUF_PANEL
// One panel_matmul call: y = x W^T for `tokens` rows of x, the first `grouped` of them also
// in xt (panel::transpose_rows' layout), the rest taken by dot products.
struct PanelProduct {
  const Matrix& w;
  const float* x;
  const float* xt;
  int64_t tokens, grouped;
  float* y;

  // Output rows [r0, r0 + count): the weights decoded once into `panel` (kPanelRows rows),
  // multiplied kMaxGroups groups at a time through `c`, then the rest's dot products.
  void rows(int64_t r0, int64_t count, float* panel, float* c) const {
    using namespace panel;
    if (count < kPanelRows) std::fill(panel, panel + kPanelRows * w.in, 0.0f);
    w.decode_rows(r0, count, panel);
    const int outputs = static_cast<int>(count);
    dot_panel(panel, x + grouped * w.in, tokens - grouped, w.in, outputs, y + grouped * w.rows + r0, w.rows);
    for (int64_t g0 = 0, groups = (grouped + kLanes - 1) / kLanes; g0 < groups; g0 += kMaxGroups) {
      const int n = static_cast<int>(std::min<int64_t>(kMaxGroups, groups - g0));
      multiply(n, panel, xt + g0 * w.in * kLanes, w.in, c);
      const int64_t t0 = g0 * kLanes;
      store_tile(c, n, std::min<int64_t>(n * kLanes, grouped - t0), outputs, y + t0 * w.rows + r0, w.rows);
    }
  }
};

// y = x W^T through gguf_panel.h: the rows transposed once (but a last group's few, which
// go by dot products), then each thread takes whole panels of kPanelRows output rows.
void panel_matmul(const Matrix& w, const at::Tensor& x, float* y) {
  using namespace panel;
  const int64_t tokens = x.size(0);
  const int64_t grouped = dots_take(tokens % kLanes, w.in) ? tokens - tokens % kLanes : tokens;
  const int64_t groups = (grouped + kLanes - 1) / kLanes;
  const int64_t panels = (w.rows + kPanelRows - 1) / kPanelRows;
  std::unique_ptr<float[]> xt(new float[std::max<int64_t>(1, groups) * w.in * kLanes]);
  transpose_rows(x.data_ptr<float>(), grouped, w.in, xt.get());
  const PanelProduct product{w, x.data_ptr<float>(), xt.get(), tokens, grouped, y};
  at::parallel_for(0, panels, std::max<int64_t>(1, 16384 / (w.in * (groups + 1))), [&](int64_t first, int64_t last) {
    std::vector<float> decoded(kPanelRows * w.in), c(kPanelRows * kMaxGroups * kLanes);
    for (int64_t p = first; p < last; ++p) {
      const int64_t r0 = p * kPanelRows;
      product.rows(r0, std::min<int64_t>(kPanelRows, w.rows - r0), decoded.data(), c.data());
    }
  });
}
#endif

// One parallel region: each thread takes whole tiles of output rows, decodes each into its own
// buffer (which stays in its L2) and multiplies it by sgemm, single-threaded inside the region.
// (Tile by tile with the threads joining twice per tile was 10x slower on a busy machine:
// every join waits for the other thread's next time slice.) InferenceMode is per thread: each
// worker takes the caller's, or its sgemm into `y` (an inference tensor) would be refused.
// Matrices up to this many fp32 bytes are decoded whole for one sgemm, which blocks x far
// better than a product per tile: 19.5 against 33 ms for 2,048 rows through a 1536 x 576
// Q4_1 matrix here (the decode itself takes 0.1 ms). Larger ones (an output matrix over a
// 262,144-token vocabulary) go tile by tile: no temporary of their whole size.
constexpr int64_t kWholeBytes = 64 << 20;

void prefill_matmul(const Matrix& w, const at::Tensor& x, at::Tensor& y) {
  if (w.rows * w.in * 4 <= kWholeBytes) {
    at::Tensor dense = at::empty({w.rows, w.in}, x.options());
    float* dst = dense.data_ptr<float>();
    at::parallel_for(0, w.rows, std::max<int64_t>(1, 65536 / w.in), [&](int64_t a, int64_t b) {
      w.decode_rows(a, b - a, dst + a * w.in);
    });
    at::mm_out(y, x, dense.t());
    return;
  }
  const int64_t tile = std::clamp<int64_t>(kTileBytes / (4 * w.in), 16, w.rows);
  const int64_t tiles = (w.rows + tile - 1) / tile;
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, tiles, 1, [&](int64_t first_tile, int64_t last_tile) {
    c10::InferenceMode guard(inference);
    at::Tensor buffer = at::empty({tile, w.in}, x.options());
    for (int64_t t = first_tile; t < last_tile; ++t) {
      const int64_t first = t * tile, count = std::min(tile, w.rows - first);
      w.decode_rows(first, count, buffer.data_ptr<float>());
      at::Tensor out = y.narrow(1, first, count);
      at::mm_out(out, x, buffer.narrow(0, 0, count).t());
    }
  });
}

}  // namespace

at::Tensor dequantize(const at::Tensor& blocks, int64_t type, int64_t in, bool portable) {
  Matrix w = matrix(blocks, type, in);
  at::Tensor out = at::empty({w.rows, in}, blocks.options().dtype(at::kFloat));
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, w.rows, std::max<int64_t>(1, 65536 / in), [&](int64_t a, int64_t b) {
    w.decode_rows(a, b - a, dst + a * in, portable);
  });
  return out;
}

// Which decoders this build has: what benchmarks print, and what tests hold against the CPU.
std::string simd_name() {
#if defined(PREFIXCACHE_GGUF_AVX512)
  return "avx512";
#elif defined(PREFIXCACHE_GGUF_AVX2)
  return "avx2";
#else
  return "portable";
#endif
}

void check_blocks(const at::Tensor& blocks, int64_t type, int64_t in) { matrix(blocks, type, in); }

bool has_int8_kernel(int64_t type) {
  const Kernels* k = kernels_of(type);
  return k != nullptr && k->int8_dots != nullptr;
}

at::Tensor matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t type, int64_t in,
                  RowLimits limits, int64_t activation_bits) {
  Matrix w = matrix(blocks, type, in);
  TORCH_CHECK(x.dtype() == at::kFloat && x.dim() == 2 && x.size(1) == in && x.is_contiguous(),
              "x must be contiguous fp32 [tokens, ", in, "]");
  at::Tensor y = at::empty({x.size(0), w.rows}, x.options());
  if (y.numel() == 0) return y;
  TORCH_CHECK(activation_bits == 32 || activation_bits == 16 || activation_bits == 8,
              "activation_bits must be 32, 16 or 8, not ", activation_bits);
  const int64_t integer_rows = activation_bits == 8 ? limits.decode : std::min(limits.decode, kInt16Rows);
  if (x.size(0) <= integer_rows && activation_bits < 32 && w.k->int8_dots) {
#ifdef PREFIXCACHE_GGUF_INT8
    if (activation_bits == 8) int8_decode_matmul<8>(w, x, y.data_ptr<float>());
    else int8_decode_matmul<16>(w, x, y.data_ptr<float>());
#endif
  } else if (x.size(0) <= limits.decode) {
    decode_matmul(w, x, y.data_ptr<float>());
#ifdef PREFIXCACHE_GGUF_PANEL
  } else if (x.size(0) <= limits.panel) {
    panel_matmul(w, x, y.data_ptr<float>());
#endif
  } else {
    prefill_matmul(w, x, y);
  }
  return y;
}

}  // namespace prefixcache::gguf
