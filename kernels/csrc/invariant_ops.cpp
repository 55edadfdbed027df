// Batch-invariant float32 matmul for the engine's batch-invariant mode (see kernels/invariant.py):
//
//   invariant_linear(x (M, K), weight (N, K), bias (N,) | None) -> x @ weight.T + bias  (M, N)
//
// BLAS libraries pick their blocking, kernels and threading by M (a decode of 3 sequences and a
// prefill of 300 tokens take different code), so a row's result depends on what else is in the
// batch. Here every output element is one dot product computed the same way wherever it sits:
// lane l of a 16-lane accumulator takes x[k] * w[k] for k = l, l + 16, ... in order (one FMA
// each; a K % 16 tail as a zero-padded vector), the 16 lanes are summed by reduce()'s fixed tree,
// then the bias is added. Tiles (MR x NR outputs in registers), row blocks and threads only
// decide which outputs are computed together, never how one is computed, so a row gives the same
// bits alone, in any batch, at any position, and in a trainer's recompute that calls this op.
//
// Speed: register tiles of accumulators (4 x 4 with AVX-512, 2 x 3 with AVX2); weight rows stay
// in L1 while a block of 64 rows of x passes under them; threads split the output columns. While
// a tile reads its weight rows, each k step prefetches the same offsets of the next tile's rows
// into L2, so a thread's weight stream never waits on DRAM (the model's 121 matmuls at 1-7 rows: 0.55-0.8x the time without).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "ops.h"
#include "vec.h"

namespace rollout_invariant {
namespace {

using rollout_vec::kWide;
using rollout_vec::L;
using rollout_vec::load;
using rollout_vec::vfloat;

// A 16-lane accumulator on every target, so an output has the same bits on AVX2 and AVX-512
// machines: one register with AVX-512, kWide = 2 registers of 8 (lanes 0-7 and 8-15) with AVX2.
constexpr int64_t kLanes = 16;
// A register tile: MR rows of x by NR rows of the weight. AVX-512: 16 of its 32 registers hold
// accumulators; AVX2: 12 of 16 (a 4 x 4 tile of 16-lane accumulators would be 32 and spill).
#if defined(__AVX512F__)
constexpr int64_t MR = 4, NR = 4;
#else
constexpr int64_t MR = 2, NR = 3;
#endif
constexpr int64_t kRowBlock = 64;  // rows of x that pass under one tile of weight rows
constexpr int64_t kParallelFmas = 1 << 17;  // below this many FMAs a call runs on one thread

// acc + a * b with one rounding, spelled out so that no code path depends on the compiler's
// choice to contract (every element must see the same operation sequence).
inline vfloat fma(vfloat a, vfloat b, vfloat acc) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  return (vfloat)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  vfloat r;
  for (int64_t l = 0; l < L; ++l) r[l] = __builtin_fmaf(a[l], b[l], acc[l]);
  return r;
#endif
}

// One 16-element step of k for every accumulator of the tile; x and w point at the step's first
// element (w_stride between weight rows). keep() holds each x and weight vector in a register for
// all the FMAs that use it: with AVX2's 16 registers GCC otherwise reloads one of the two from
// memory in every FMA (16 loads per 12 FMAs instead of 10).
template <int64_t R, int64_t C>
inline void tile_step(vfloat (&acc)[R][C][kWide], const float* const (&x)[R], const float* w, int64_t w_stride) {
#pragma GCC unroll 2
  for (int64_t h = 0; h < kWide; ++h) {
    vfloat xv[R];
#pragma GCC unroll 4
    for (int64_t i = 0; i < R; ++i) xv[i] = rollout_vec::keep(load(x[i] + h * L));
#pragma GCC unroll 4
    for (int64_t j = 0; j < C; ++j) {
      const vfloat wv = rollout_vec::keep(load(w + j * w_stride + h * L));
#pragma GCC unroll 4
      for (int64_t i = 0; i < R; ++i) acc[i][j][h] = fma(xv[i], wv, acc[i][j][h]);
    }
  }
}

// out[i, j] for i < R rows of x (stride sx) and j < C rows of w (stride K), R <= MR, C <= NR;
// prefetches C rows of K floats at `next` along the way.
template <int64_t R, int64_t C>
void tile(const float* x, int64_t sx, const float* w, int64_t K, const float* bias, float* out,
          int64_t so, const char* next) {
  vfloat acc[R][C][kWide];
#pragma GCC unroll 4
  for (int64_t i = 0; i < R; ++i)
#pragma GCC unroll 4
    for (int64_t j = 0; j < C; ++j)
#pragma GCC unroll 2
      for (int64_t h = 0; h < kWide; ++h) acc[i][j][h] = vfloat{};
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
#pragma GCC unroll 4
    for (int64_t j = 0; j < C; ++j) __builtin_prefetch(next + (j * K + k) * sizeof(float), 0, 1);
    const float* xr[R];
#pragma GCC unroll 4
    for (int64_t i = 0; i < R; ++i) xr[i] = x + i * sx + k;
    tile_step<R, C>(acc, xr, w + k, K);
  }
  if (k < K) {  // the last K - k < 16 elements as one zero-padded step
    float xt[R][kLanes] = {}, wt[C][kLanes] = {};
    const float* xr[R];
    for (int64_t i = 0; i < R; ++i) std::memcpy(xt[i], x + i * sx + k, (K - k) * sizeof(float)), xr[i] = xt[i];
    for (int64_t j = 0; j < C; ++j) std::memcpy(wt[j], w + j * K + k, (K - k) * sizeof(float));
    tile_step<R, C>(acc, xr, wt[0], kLanes);
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) {
      const float dot = rollout_vec::reduce_wide(acc[i][j], true);
      out[i * so + j] = bias ? dot + bias[j] : dot;
    }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, const char*);

template <int64_t R, int64_t... Cs>
constexpr auto tile_row(std::integer_sequence<int64_t, Cs...>) {
  return std::array<TileFn, NR>{&tile<R, Cs + 1>...};
}
template <int64_t... Rs>
constexpr auto tile_table(std::integer_sequence<int64_t, Rs...>) {
  return std::array<std::array<TileFn, NR>, MR>{tile_row<Rs + 1>(std::make_integer_sequence<int64_t, NR>{})...};
}
// kTiles[R - 1][C - 1] = tile<R, C>: the full tile and every edge tile.
constexpr auto kTiles = tile_table(std::make_integer_sequence<int64_t, MR>{});

}  // namespace

at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "invariant_linear: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "invariant_linear: float32 only (x ", x.scalar_type(), ", weight ",
              weight.scalar_type(), ")");
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "invariant_linear: x must be (M, K) with a contiguous last dim");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(1),
              "invariant_linear: weight must be a contiguous (N, K) tensor with x's K = ",
              x.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0), sx = x.stride(0);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->dim() == 1 &&
                    bias->size(0) == N && bias->stride(0) == 1,
                "invariant_linear: bias must be a contiguous float32 (N,) tensor");
    b = bias->data_ptr<float>();
  }
  at::Tensor out = at::Tensor(at::detail::empty_cpu({M, N}, at::kFloat));
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n_tiles = (N + NR - 1) / NR;
  auto run = [&](int64_t t0, int64_t t1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlock) {
      const int64_t m1 = std::min(M, m0 + kRowBlock);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n = t * NR, C = std::min(NR, N - n);
        for (int64_t m = m0; m < m1; m += MR) {
          const int64_t R = std::min(MR, m1 - m);
          kTiles[R - 1][C - 1](xp + m * sx, sx, wp + n * K, K, b ? b + n : nullptr, op + m * N + n, N,
                               reinterpret_cast<const char*>(wp + std::min(n + NR, N - C) * K));
        }
      }
    }
  };
  const int64_t fmas_per_tile = std::max<int64_t>(1, M * NR * K);
  if (n_tiles * fmas_per_tile < kParallelFmas || at::get_num_threads() == 1) run(0, n_tiles);
  else at::parallel_for(0, n_tiles, std::max<int64_t>(1, kParallelFmas / fmas_per_tile), run);
  return out;
}

}  // namespace rollout_invariant
