// A float32 matmul for every step size on CPUs with AVX-512 or AVX2 + FMA, on a weight packed once
// into memory the engine keeps (a weight update repacks in place):
//
//   f32_panel_pack(weight (N, K), out=None) -> packed (ceil(N/32), K, 32) float32
//   f32_panel_linear(x (M, K), packed, N, bias (N,) | None) -> x @ weight.T + bias  (M, N)
//
// Why: oneDNN's prepacked GEMM took steps of more than a few rows, and its packed copy can only
// be made in fresh memory (torch.ops.mkldnn._reorder_linear_weight has no output argument):
// page faults made that reorder most of a float32 weight update (~0.2-0.3 s for the default
// model's 0.54 GB on a 2-core Xeon). Here the packed copy is rewritten where it is.
//
// The layout is the outer-product one: a panel holds 32 output columns, k-major, so one k step
// is 128 contiguous bytes (two vectors) and a register tile of up to MR rows x 32 columns takes
// two weight loads and 2 * MR FMAs with x[k] broadcast, no horizontal sums. Each thread streams
// a contiguous run of panels; every MR-row pass over a panel after the first finds it in L2, and
// prefetches a slice of the next panel (vnni_linear.cpp's schedule). Each output is one chain
// of FMAs in k order (then + bias): the same bits whatever else is in the batch, and on AVX-512 and
// AVX2 alike. With AVX2 (16 registers of 8 floats) a register tile is up to 6 rows x 16 columns,
// one half of a panel (12 accumulators, two weight loads and 6 broadcasts per k), the halves one
// after the other; a tile of up to 3 rows spans the whole panel (4 chains a row in flight, both
// cache lines of a k step read together: 15-25% faster than two half tiles at 1-2 rows).
//
// The same tiles serve bf16 on CPUs without AVX-512 BF16 (vnni_linear.cpp needs it, and oneDNN's
// bf16 linear needs AVX-512 or AVX-NE-CONVERT: on an AVX2 CPU torch's bf16 matmul ran 5-8x slower
// than its float32 one):
//
//   bf16_panel_pack(weight (N, K) bf16, out=None) -> packed (ceil(N/32), K, 32) bf16
//   bf16_panel_linear(x (M, K) bf16, packed, N, bias (N,) bf16 | None) -> (M, N) bf16
//
// The weights stay bf16 in memory (half the bytes a decode step streams) and are widened to
// float32 in registers: a k step is one 64-byte line, its columns stored in pairs so that one
// load, a shift and a mask give two vectors. x is widened once per call; the sums are the float32
// kernel's FMA chains, rounded to bf16 once at the end.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#define ROLLOUT_F32_PANEL 512  // the vector width in bits
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define ROLLOUT_F32_PANEL 256
#endif

#include "bf16_round.h"
#include "ops.h"
#include "pack_ahead.h"

namespace rollout_f32 {

constexpr int64_t kPanel = 32;

bool f32_panel_supported() {
#if ROLLOUT_F32_PANEL
  return true;
#else
  return false;
#endif
}

#if ROLLOUT_F32_PANEL
namespace {

// Packing moves kBlock x kBlock blocks of floats, transposed in registers (see f32_panel_pack).
#if ROLLOUT_F32_PANEL == 512
constexpr int64_t kBlock = 16;
typedef __m512 BlockRow;
inline BlockRow load_row(const float* p) { return _mm512_loadu_ps(p); }
inline BlockRow load_block_row(const float* p) { return _mm512_load_ps(p); }
inline void store_row(float* p, BlockRow v) { _mm512_store_ps(p, v); }
inline void stream_row(float* p, BlockRow v) { _mm512_stream_ps(p, v); }

// rows in r, columns out
inline void transpose(BlockRow r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 ab02 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0x88), ab13 = _mm512_shuffle_f32x4(r[m], r[4 + m], 0xdd);
    const __m512 cd02 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0x88),
                 cd13 = _mm512_shuffle_f32x4(r[8 + m], r[12 + m], 0xdd);
    t[m] = _mm512_shuffle_f32x4(ab02, cd02, 0x88);
    t[4 + m] = _mm512_shuffle_f32x4(ab13, cd13, 0x88);
    t[8 + m] = _mm512_shuffle_f32x4(ab02, cd02, 0xdd);
    t[12 + m] = _mm512_shuffle_f32x4(ab13, cd13, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#else
constexpr int64_t kBlock = 8;
typedef __m256 BlockRow;
inline BlockRow load_row(const float* p) { return _mm256_loadu_ps(p); }
inline BlockRow load_block_row(const float* p) { return _mm256_load_ps(p); }
inline void store_row(float* p, BlockRow v) { _mm256_store_ps(p, v); }
inline void stream_row(float* p, BlockRow v) { _mm256_stream_ps(p, v); }

inline void transpose(BlockRow r[8]) {
  __m256 t[8], s[8];
  for (int i = 0; i < 8; i += 2) {  // t[i] = a0 b0 a1 b1 | a4 b4 a5 b5, t[i + 1] = a2 b2 a3 b3 | a6 b6 a7 b7
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // s[i + j] = column j | column j + 4 of rows i .. i + 3
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x20);
    r[4 + j] = _mm256_permute2f128_ps(s[j], s[4 + j], 0x31);
  }
}
#endif

}  // namespace
#endif

namespace {

const char* dtype_name(at::ScalarType t) { return t == at::kFloat ? "float32" : "bfloat16"; }

// The (ceil(N/32), K, 32) tensor a pack of w (N, K) writes: `out` when given (a repack in place), else fresh.
at::Tensor panels_for(const char* fn, const at::Tensor& w, const std::optional<at::Tensor>& out) {
  const int64_t NP = (w.size(0) + kPanel - 1) / kPanel, K = w.size(1);
  if (!out.has_value()) return at::empty({NP, K, kPanel}, w.options());
  TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == w.scalar_type() && out->is_contiguous() &&
                  out->sizes() == at::IntArrayRef({NP, K, kPanel}),
              fn, ": out must be a contiguous ", dtype_name(w.scalar_type()), " (", NP, ", ", K, ", ", kPanel,
              ") CPU tensor");
  return *out;
}

}  // namespace

void f32_pack_panels(const float* src, float* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const float* rows = src + p * kPanel * ld;
    float* d = dst + p * K * kPanel;
    int64_t k = 0;
#if ROLLOUT_F32_PANEL
    if (cols == kPanel && reinterpret_cast<uintptr_t>(dst) % sizeof(BlockRow) == 0 && kBlock * sizeof(float) == 64) {
      // AVX-512: a block row is a whole cache line, so each kBlock rows of the panel go through
      // all of K on their own, every kBlock x kBlock block transposed in registers and streamed
      // out as whole lines: 16 rows read side by side instead of 32 (which the prefetchers did
      // not keep up with: 1.8x slower), no line read before it is written
      BlockRow r[kBlock];
      rollout_pack::PanelAhead ahead(src, 4, N, K, ld, p, p1, kPanel / kBlock * (K / kBlock));
      for (int64_t h = 0; h < kPanel / kBlock; ++h) {
        for (k = 0; k + kBlock <= K; k += kBlock) {
          ahead.step();
          for (int64_t i = 0; i < kBlock; ++i) {
            const float* row = rows + (h * kBlock + i) * ld + k;
            r[i] = load_row(row);
            __builtin_prefetch(row + 64);
          }
          transpose(r);
          for (int64_t j = 0; j < kBlock; ++j) stream_row(d + (k + j) * kPanel + h * kBlock, r[j]);
        }
      }
      _mm_sfence();
    } else if (cols == kPanel && reinterpret_cast<uintptr_t>(dst) % sizeof(BlockRow) == 0) {
      // AVX2: a block row is half a line; each kBlock x kBlock block is transposed in registers
      // into a block of kBlock whole k steps in L1, which then goes out as streamed stores in
      // order (the packed copy is not read again soon; a store that skips the cache skips reading
      // the line first, and whole lines in order keep the write-combining buffers from flushing halves)
      alignas(64) float block[kBlock * kPanel];
      BlockRow r[kBlock];
      rollout_pack::PanelAhead ahead(src, 4, N, K, ld, p, p1, K / kBlock);
      for (; k + kBlock <= K; k += kBlock) {
        ahead.step();
        for (int64_t h = 0; h < kPanel / kBlock; ++h) {
          for (int64_t i = 0; i < kBlock; ++i) {
            const float* row = rows + (h * kBlock + i) * ld + k;
            r[i] = load_row(row);
            __builtin_prefetch(row + 64);  // 32 rows read side by side: more than the prefetcher follows
          }
          transpose(r);
          for (int64_t j = 0; j < kBlock; ++j) store_row(block + j * kPanel + h * kBlock, r[j]);
        }
        for (int64_t i = 0; i < kBlock * kPanel; i += kBlock)
          stream_row(d + k * kPanel + i, load_block_row(block + i));
      }
      _mm_sfence();
    }
#endif
    for (; k < K; ++k) {  // (the rest: scalar; columns past N are zeros)
      for (int64_t c = 0; c < cols; ++c) d[k * kPanel + c] = rows[c * ld + k];
      for (int64_t c = cols; c < kPanel; ++c) d[k * kPanel + c] = 0.0f;
    }
  }
}

at::Tensor f32_panel_pack(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "f32_panel_pack: a float32 (N, K) CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NP = (N + kPanel - 1) / kPanel;
  at::Tensor packed = panels_for("f32_panel_pack", w, out);
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) { f32_pack_panels(src, dst, N, K, K, p0, p1); });
  return packed;
}

#if ROLLOUT_F32_PANEL
namespace {

// The bf16 panel layout: a k step is one 64-byte line of 32 columns, each vector-sized group of
// columns stored as pairs (c, c + L) of bf16 (L = the vector's lanes: 16 with AVX-512, 8 with
// AVX2), so one load of 2L bf16 gives two vectors of floats by a shift and a mask, no shuffles:
// bf16 bits are a float's top half. Position q of a k step holds column kBf16Col[q].
#if ROLLOUT_F32_PANEL == 512
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
constexpr std::array<int64_t, kPanel> bf16_columns() {
  std::array<int64_t, kPanel> col{};
  for (int64_t q = 0; q < kPanel; ++q) {
    const int64_t group = q / (2 * kLanes), j = q % (2 * kLanes);
    col[q] = group * 2 * kLanes + j / 2 + (j % 2) * kLanes;
  }
  return col;
}
constexpr std::array<int64_t, kPanel> kBf16Col = bf16_columns();

// Two 8 x 8 transposes of 16-bit values, one per 128-bit lane: r[i] holds row i's 8 + 8 values;
// afterwards r[j] holds column j of each lane's block.
inline void transpose8x8_epi16(__m256i r[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi16(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi16(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi32(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi32(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi32(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi32(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    r[2 * j] = _mm256_unpacklo_epi64(u[j], u[4 + j]);
    r[2 * j + 1] = _mm256_unpackhi_epi64(u[j], u[4 + j]);
  }
}

// a source row's 16 values from k on as bf16 (a float32 one rounded as torch's cast rounds), and one value
inline __m256i load16(const uint16_t* row) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)); }
inline __m256i load16(const float* row) {
  return _mm256_set_m128i(rollout_bf16::round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8))),
                          rollout_bf16::round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row))));
}
inline uint16_t bits(uint16_t v) { return v; }
inline uint16_t bits(float v) { return rollout_bf16::round_bits(v); }

}  // namespace
#endif

namespace {

// bf16_pack_panels of a bfloat16 source, or of a float32 one cast on the way
template <typename T>
void pack_bf16_panels(const T* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
#if ROLLOUT_F32_PANEL
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const T* rows = src + p * kPanel * ld;
    uint16_t* d = dst + p * K * kPanel;
    int64_t k = 0;
    if (cols == kPanel && reinterpret_cast<uintptr_t>(dst) % 32 == 0) {
      // full panels, 16 k at a time: each 8 positions of a step two transposes (one per lane),
      // gathered in a 1 KB block whose 16 lines then go out as streamed stores (the packed copy is
      // not read again soon; a store that skips the cache skips reading the line first)
      alignas(64) uint16_t block[16][kPanel];
      __m256i r[8];
      rollout_pack::PanelAhead ahead(src, sizeof(T), N, K, ld, p, p1, K / 16);
      for (; k + 16 <= K; k += 16) {
        ahead.step();
        for (int64_t q = 0; q < kPanel; q += 8) {
          for (int64_t i = 0; i < 8; ++i) {
            const T* row = rows + kBf16Col[q + i] * ld + k;
            r[i] = load16(row);
            // 32 rows read side by side: more streams than the prefetcher follows
            __builtin_prefetch(reinterpret_cast<const char*>(row) + 256);
          }
          transpose8x8_epi16(r);
          for (int64_t j = 0; j < 8; ++j) {
            _mm_store_si128(reinterpret_cast<__m128i*>(block[j] + q), _mm256_castsi256_si128(r[j]));
            _mm_store_si128(reinterpret_cast<__m128i*>(block[8 + j] + q), _mm256_extracti128_si256(r[j], 1));
          }
        }
        for (int64_t j = 0; j < 16; ++j)
          for (int64_t h = 0; h < kPanel; h += 16)
            _mm256_stream_si256(reinterpret_cast<__m256i*>(d + (k + j) * kPanel + h),
                                _mm256_load_si256(reinterpret_cast<const __m256i*>(block[j] + h)));
      }
      _mm_sfence();
    }
    for (; k < K; ++k)  // (the rest: scalar; columns past N are zeros)
      for (int64_t q = 0; q < kPanel; ++q)
        d[k * kPanel + q] = kBf16Col[q] < cols ? bits(rows[kBf16Col[q] * ld + k]) : 0;
  }
#else
  TORCH_CHECK(false, "bf16_panel_pack: this CPU has neither AVX-512 nor AVX2 + FMA (see f32_panel_supported)");
#endif
}

}  // namespace

void bf16_pack_panels(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
  pack_bf16_panels(src, dst, N, K, ld, p0, p1);
}

void bf16_pack_panels(const float* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
  pack_bf16_panels(src, dst, N, K, ld, p0, p1);
}

at::Tensor bf16_panel_pack(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "bf16_panel_pack: a bfloat16 (N, K) CPU tensor");
#if ROLLOUT_F32_PANEL
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NP = (N + kPanel - 1) / kPanel;
  at::Tensor packed = panels_for("bf16_panel_pack", w, out);
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) { bf16_pack_panels(src, dst, N, K, K, p0, p1); });
  return packed;
#else
  TORCH_CHECK(false, "bf16_panel_pack: this CPU has neither AVX-512 nor AVX2 + FMA (see f32_panel_supported)");
#endif
}

#if ROLLOUT_F32_PANEL
namespace {

constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of itself a lone pass over a panel prefetches

// One k step's prefetch: the line at p, and the next one too when the step is 128 bytes (a
// float32 panel's k row); into L2 when kL2 (the fast rate of one or two passes a panel).
template <bool kL2>
inline void prefetch_step(const char* p, int64_t step) {
  if constexpr (kL2) {
    __builtin_prefetch(p, 0, 1);
    if (step > 64) __builtin_prefetch(p + 64, 0, 1);
  } else {
    __builtin_prefetch(p);
    if (step > 64) __builtin_prefetch(p + 64);
  }
}

#if ROLLOUT_F32_PANEL == 512
typedef __m512 Vec;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_store_ps(p, v); }
inline Vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vload_pair(const uint16_t* p, Vec& lo, Vec& hi) {  // 2L bf16 in the pair layout -> 2 vectors
  const __m512i u = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
constexpr int64_t MR = 12;  // rows of x per register tile (x 32 columns: 24 accumulators)
constexpr int64_t kTileVecs = 2;  // a tile spans the whole panel
#else
typedef __m256 Vec;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_store_ps(p, v); }
inline Vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vload_pair(const uint16_t* p, Vec& lo, Vec& hi) {
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
constexpr int64_t MR = 6;  // rows of x per register tile (x 16 columns: 12 accumulators)
constexpr int64_t kTileVecs = 2;  // a tile spans half a panel ...
constexpr int64_t kWideRows = 3;  // ... but up to this many rows the whole panel (x 32 columns)
#endif

// V vectors of one k step's columns from w (the tile's first column): float32 loads, or bf16 pairs
template <int64_t V>
inline void load_step(const float* w, Vec wv[V]) {
#pragma GCC unroll 4
  for (int64_t v = 0; v < V; ++v) wv[v] = vload(w + kLanes * v);
}
template <int64_t V>
inline void load_step(const uint16_t* w, Vec wv[V]) {
#pragma GCC unroll 2
  for (int64_t v = 0; v < V; v += 2) vload_pair(w + kLanes * v, wv[v], wv[v + 1]);
}

inline float to_float(float v) { return v; }
inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
template <typename OT>
inline OT from_float(float v) { return OT(v); }  // bf16: rounded to nearest even, as torch rounds

// out[i, 0:cols] (cols <= L * V) for i < R rows of x (float32, row stride sx) from V vectors of a
// panel's columns (w: the first; a k step is kPanel weights): half a panel (AVX2, V = 2), or all
// of it (AVX-512; AVX2 with V = 4 for few rows, whose tile then reads both cache lines of a float32
// k step and keeps 4 independent chains a row in flight). pf != null: each k also prefetches
// pf + k * pf_step, for the whole panel; a second half passes null.
template <int64_t R, int64_t V, bool kL2, typename WT, typename OT>
void tile_v(const float* x, int64_t sx, int64_t K, const WT* w, const OT* bias, int64_t cols, OT* out, int64_t so,
            const char* pf, int64_t pf_step) {
  // acc[V * i + v]: row i's columns Lv .. Lv + L - 1. The loops over it are unrolled by pragma: left
  // to itself GCC 12 makes its zeroing a memset and then stores every accumulator to the stack
  // after each FMA (half the speed).
  Vec acc[V * R];
#pragma GCC unroll 24
  for (int64_t i = 0; i < V * R; ++i) acc[i] = vzero();
  for (int64_t k = 0; k < K; ++k) {
    Vec wv[V];
    load_step<V>(w + k * kPanel, wv);
    if (pf) prefetch_step<kL2>(pf + k * pf_step, pf_step);
#pragma GCC unroll 16
    for (int64_t i = 0; i < R; ++i) {
      const Vec xv = vbroadcast(x + i * sx + k);
#pragma GCC unroll 4
      for (int64_t v = 0; v < V; ++v) acc[V * i + v] = vfma(xv, wv[v], acc[V * i + v]);
    }
  }
  // (Through a buffer: masked stores of the accumulators also sent them to memory in the loop.)
  alignas(64) float buf[R][kLanes * V];
#pragma GCC unroll 16
  for (int64_t i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int64_t v = 0; v < V; ++v) vstore(buf[i] + kLanes * v, acc[V * i + v]);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < cols; ++c) out[i * so + c] = from_float<OT>(buf[i][c] + (bias ? to_float(bias[c]) : 0.0f));
}

template <typename WT, typename OT>
struct Tiles {
  using Fn = void (*)(const float*, int64_t, int64_t, const WT*, const OT*, int64_t, OT*, int64_t, const char*,
                      int64_t);
  template <int64_t V, bool kL2, int64_t... Rs>
  static constexpr std::array<Fn, sizeof...(Rs)> make(std::integer_sequence<int64_t, Rs...>) {
    return {&tile_v<Rs + 1, V, kL2, WT, OT>...};
  }
  static constexpr std::array<Fn, MR> kTiles[2] = {make<kTileVecs, false>(std::make_integer_sequence<int64_t, MR>{}),
                                                   make<kTileVecs, true>(std::make_integer_sequence<int64_t, MR>{})};
#if ROLLOUT_F32_PANEL == 256
  static constexpr std::array<Fn, kWideRows> kWide[2] = {
      make<4, false>(std::make_integer_sequence<int64_t, kWideRows>{}),
      make<4, true>(std::make_integer_sequence<int64_t, kWideRows>{})};
#endif
};

// x (M, K) float32 rows (stride sx) @ the packed panels (NP of them, K x 32 weights of type WT) -> out (M, N).
template <typename WT, typename OT>
void panel_matmul(const float* xp, int64_t sx, int64_t M, int64_t K, const WT* wp, int64_t N, const OT* bp, OT* op) {
  using T = Tiles<WT, OT>;
  const int64_t NP = (N + kPanel - 1) / kPanel, panel = K * kPanel;
  const int64_t step_bytes = kPanel * static_cast<int64_t>(sizeof(WT)), panel_bytes = K * step_bytes;
  // The prefetch schedule of vnni_linear.cpp: one pass (<= MR rows, a pure weight stream)
  // prefetches kPrefetchBytes ahead of itself; with several, pass j prefetches the j-th slice
  // of the thread's next panel while this one's arithmetic runs.
  const int64_t passes = (M + MR - 1) / MR, slice_step = step_bytes / passes;
  auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
      const char* here = reinterpret_cast<const char*>(wp + p * panel);
      for (int64_t m = 0, j = 0; m < M; m += MR, ++j) {
        const int64_t R = std::min(MR, M - m);
        const bool ahead = passes == 1 || (j == 0 && p == p0);
        const char* pf = ahead ? here + kPrefetchBytes
                         : p + 1 < p1 ? here + panel_bytes + j * panel_bytes / passes
                         : here;
        const int64_t pf_step = ahead ? step_bytes : slice_step;
#if ROLLOUT_F32_PANEL == 256
        if (R <= kWideRows) {  // few rows: the whole panel in one tile
          T::kWide[passes <= 2][R - 1](xp + m * sx, sx, K, wp + p * panel, bp ? bp + p * kPanel : nullptr, cols,
                                       op + m * N + p * kPanel, N, pf, pf_step);
          continue;
        }
#endif
        constexpr int64_t tile_cols = kLanes * kTileVecs;
        const auto fn = T::kTiles[passes <= 2][R - 1];
        for (int64_t c = 0; c < cols; c += tile_cols)  // (AVX2: the panel's two halves; the first prefetches)
          fn(xp + m * sx, sx, K, wp + p * panel + c, bp ? bp + p * kPanel + c : nullptr,
             std::min(tile_cols, cols - c), op + m * N + p * kPanel + c, N, c == 0 ? pf : nullptr, pf_step);
      }
    }
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, NP * panel_bytes / (1 << 16)));
  if (threads <= 1) run(0, NP);
  else at::parallel_for(0, NP, (NP + threads - 1) / threads, run);
}

// x (M, K) @ weight.T + bias from the packed panels; x, weights, bias and output all float (or all
// at::BFloat16: x is widened to float32 once, exactly, so the tiles broadcast floats).
template <typename T>
at::Tensor panel_linear(const char* fn, const char* pack, const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const std::optional<at::Tensor>& bias) {
  constexpr at::ScalarType st = std::is_same_v<T, float> ? at::kFloat : at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == st && x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              fn, ": x must be a ", dtype_name(st), " (M, K) CPU tensor with a contiguous last dim");
  const int64_t M = x.size(0), K = x.size(1), NP = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(packed.scalar_type() == st && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({NP, K, kPanel}),
              fn, ": packed must come from ", pack, " of an (", N, ", ", K, ") weight");
  const T* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == st && bias->dim() == 1 && bias->size(0) == N && bias->stride(0) == 1,
                fn, ": bias must be a contiguous ", dtype_name(st), " (N,) tensor");
    bp = bias->data_ptr<T>();
  }
  at::Tensor out = at::Tensor(at::detail::empty_cpu({M, N}, st));
  if (M == 0 || N == 0) return out;
  if constexpr (std::is_same_v<T, float>) {
    panel_matmul(x.data_ptr<float>(), x.stride(0), M, K, packed.data_ptr<float>(), N, bp, out.data_ptr<float>());
  } else {
    at::Tensor xf = at::Tensor(at::detail::empty_cpu({M, K}, at::kFloat));
    const uint16_t* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    uint32_t* xd = reinterpret_cast<uint32_t*>(xf.data_ptr<float>());
    const int64_t sx = x.stride(0);
    at::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t k = 0; k < K; ++k) xd[m * K + k] = static_cast<uint32_t>(xs[m * sx + k]) << 16;
    });
    panel_matmul(xf.data_ptr<float>(), K, M, K, reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
                 N, bp, out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace
#endif

at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const std::optional<at::Tensor>& bias) {
#if ROLLOUT_F32_PANEL
  return panel_linear<float>("f32_panel_linear", "f32_panel_pack", x, packed, N, bias);
#else
  TORCH_CHECK(false, "f32_panel_linear: this CPU has neither AVX-512 nor AVX2 + FMA (see f32_panel_supported)");
#endif
}

at::Tensor bf16_panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias) {
#if ROLLOUT_F32_PANEL
  return panel_linear<at::BFloat16>("bf16_panel_linear", "bf16_panel_pack", x, packed, N, bias);
#else
  TORCH_CHECK(false, "bf16_panel_linear: this CPU has neither AVX-512 nor AVX2 + FMA (see f32_panel_supported)");
#endif
}

}  // namespace rollout_f32
