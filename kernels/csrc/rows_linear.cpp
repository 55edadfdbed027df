// A bfloat16 matmul for steps of few rows (the decode of 1-7 sequences):
//
//   bf16_rows_linear(x (M, K), weight (N, K), bias (N,) | None) -> x @ weight.T + bias  (M, N)
//
// With few rows a projection is a read of its weights: oneDNN's GEMM, built for many rows,
// reaches a fraction of the memory bandwidth there. This kernel streams each block of NR weight
// rows once, keeps it in L1 while every row of x passes under it (MR rows at a time in
// registers), and splits the weight rows between threads. Sums run in float32 (AVX-512 BF16's
// dot-product instruction where the CPU has it; else bf16 widened to float32 and FMAs), the
// bias is added in float32 and each output rounded to bf16 once (round to nearest even): what
// oneDNN and F.linear compute, up to the order of the float32 sums.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ROLLOUT_DPBF16 1
#endif

#include "ops.h"
#include "vec.h"

namespace rollout_rows {
namespace {

using namespace rollout_vec;

constexpr int64_t MR = 4, NR = 4;  // a register tile: MR rows of x by NR weight rows
constexpr int64_t kParallelBytes = 1 << 16;  // below this many weight bytes a call runs on one thread

#if ROLLOUT_DPBF16
constexpr int64_t kStep = 32;  // bf16 elements per dot-product instruction
typedef __m512 acc_t;
inline acc_t acc_zero() { return _mm512_setzero_ps(); }
inline __m512i load_step(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline __m512i load_tail(const uint16_t* p, int64_t n) {
  return _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << n) - 1), p);
}
inline acc_t dot_step(acc_t acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}
inline float acc_sum(acc_t acc) { return _mm512_reduce_add_ps(acc); }
typedef __m512i step_t;
#else
constexpr int64_t kStep = L;  // bf16 widened to float32, L at a time
typedef vfloat acc_t;
typedef vfloat step_t;
inline acc_t acc_zero() { return vfloat{}; }
inline vfloat widen(vhalf h) { return (vfloat)(__builtin_convertvector(h, vuint) << 16); }
inline step_t load_step(const uint16_t* p) { return widen(*reinterpret_cast<const vhalf_mem*>(p)); }
inline step_t load_tail(const uint16_t* p, int64_t n) {
  vhalf h{};
  for (int64_t i = 0; i < n; ++i) h[i] = p[i];
  return widen(h);
}
inline acc_t dot_step(acc_t acc, step_t a, step_t b) { return acc + a * b; }
inline float acc_sum(acc_t acc) { return reduce(acc, plus); }
#endif

// out[i, j] for i < R rows of x (row stride sx) and j < C weight rows (stride K).
template <int64_t R, int64_t C>
void tile(const uint16_t* x, int64_t sx, const uint16_t* w, int64_t K, const c10::BFloat16* bias,
          c10::BFloat16* out, int64_t so) {
  acc_t acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) acc[i][j] = acc_zero();
  int64_t k = 0;
  for (; k + kStep <= K; k += kStep) {
    step_t wv[C];
    for (int64_t j = 0; j < C; ++j) {
      __builtin_prefetch(w + (j + 2 * NR) * K + k);  // two tiles ahead (may run past the end: a hint)
      wv[j] = load_step(w + j * K + k);
    }
    for (int64_t i = 0; i < R; ++i) {
      const step_t xv = load_step(x + i * sx + k);
      for (int64_t j = 0; j < C; ++j) acc[i][j] = dot_step(acc[i][j], xv, wv[j]);
    }
  }
  if (k < K) {
    step_t wv[C];
    for (int64_t j = 0; j < C; ++j) wv[j] = load_tail(w + j * K + k, K - k);
    for (int64_t i = 0; i < R; ++i) {
      const step_t xv = load_tail(x + i * sx + k, K - k);
      for (int64_t j = 0; j < C; ++j) acc[i][j] = dot_step(acc[i][j], xv, wv[j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) {
      const float dot = acc_sum(acc[i][j]);
      out[i * so + j] = c10::BFloat16(bias ? dot + static_cast<float>(bias[j]) : dot);
    }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const c10::BFloat16*,
                        c10::BFloat16*, int64_t);

template <int64_t R, int64_t... Cs>
constexpr auto tile_row(std::integer_sequence<int64_t, Cs...>) {
  return std::array<TileFn, NR>{&tile<R, Cs + 1>...};
}
template <int64_t... Rs>
constexpr auto tile_table(std::integer_sequence<int64_t, Rs...>) {
  return std::array<std::array<TileFn, NR>, MR>{tile_row<Rs + 1>(std::make_integer_sequence<int64_t, NR>{})...};
}
constexpr auto kTiles = tile_table(std::make_integer_sequence<int64_t, MR>{});  // [R - 1][C - 1]

}  // namespace

at::Tensor bf16_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_rows_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "bf16_rows_linear: bfloat16 only (x ", x.scalar_type(), ", weight ", weight.scalar_type(), ")");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "bf16_rows_linear: x must be (M, K) with a contiguous last dim");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "bf16_rows_linear: weight must be a contiguous (N, K) tensor with x's K = ", x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), sx = x.stride(0);
  const c10::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kBFloat16 && bias->dim() == 1 &&
                    bias->size(0) == N && bias->stride(0) == 1,
                "bf16_rows_linear: bias must be a contiguous bfloat16 (N,) tensor");
    b = bias->data_ptr<c10::BFloat16>();
  }
  at::Tensor out = at::Tensor(at::detail::empty_cpu({M, N}, at::kBFloat16));
  if (M == 0 || N == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t n_tiles = (N + NR - 1) / NR;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * NR, C = std::min(NR, N - n);
      for (int64_t m = 0; m < M; m += MR) {
        const int64_t R = std::min(MR, M - m);
        kTiles[R - 1][C - 1](xp + m * sx, sx, wp + n * K, K, b ? b + n : nullptr, op + m * N + n, N);
      }
    }
  };
  const int64_t tile_bytes = NR * K * 2;
  if (n_tiles * tile_bytes < kParallelBytes || at::get_num_threads() == 1) run(0, n_tiles);
  else at::parallel_for(0, n_tiles, std::max<int64_t>(1, kParallelBytes / tile_bytes), run);
  return out;
}

}  // namespace rollout_rows
