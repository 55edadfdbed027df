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
// Speed: 4 x 4 tiles of accumulators; weight rows stay in L1 while a block of 64 rows of x
// passes under them; threads split the output columns. While a tile reads its 4 weight rows,
// each k step prefetches the same offsets of the next tile's rows into L2, so a thread's weight
// stream never waits on DRAM (the model's 121 matmuls at 1-7 rows: 0.55-0.8x the time without).
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "vec.h"

namespace rollout_invariant {
namespace {

using rollout_vec::plus;
using rollout_vec::reduce;

// 16 lanes on every target (two registers with AVX2), so an output has the same bits on AVX2 and
// AVX-512 machines.
constexpr int64_t L = 16;
typedef rollout_vec::vfloat16 vfloat;
inline vfloat load(const float* p) { return *reinterpret_cast<const rollout_vec::Lanes<16>::f_mem*>(p); }

constexpr int64_t MR = 4, NR = 4;  // a register tile: MR rows of x by NR rows of the weight
constexpr int64_t kRowBlock = 64;  // rows of x that pass under one tile of weight rows
constexpr int64_t kParallelFmas = 1 << 17;  // below this many FMAs a call runs on one thread

// acc + a * b with one rounding, spelled out so that no code path depends on the compiler's
// choice to contract (every element must see the same operation sequence).
inline vfloat fma(vfloat a, vfloat b, vfloat acc) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#else
  return vfloat{__builtin_fmaf(a[0], b[0], acc[0]), __builtin_fmaf(a[1], b[1], acc[1]),
                __builtin_fmaf(a[2], b[2], acc[2]), __builtin_fmaf(a[3], b[3], acc[3]),
                __builtin_fmaf(a[4], b[4], acc[4]), __builtin_fmaf(a[5], b[5], acc[5]),
                __builtin_fmaf(a[6], b[6], acc[6]), __builtin_fmaf(a[7], b[7], acc[7]),
                __builtin_fmaf(a[8], b[8], acc[8]), __builtin_fmaf(a[9], b[9], acc[9]),
                __builtin_fmaf(a[10], b[10], acc[10]), __builtin_fmaf(a[11], b[11], acc[11]),
                __builtin_fmaf(a[12], b[12], acc[12]), __builtin_fmaf(a[13], b[13], acc[13]),
                __builtin_fmaf(a[14], b[14], acc[14]), __builtin_fmaf(a[15], b[15], acc[15])};
#endif
}

inline vfloat load_tail(const float* p, int64_t n) {  // n < L elements, the other lanes 0
  float tmp[L] = {};
  std::memcpy(tmp, p, n * sizeof(float));
  return load(tmp);
}

// out[i, j] for i < R rows of x (stride sx) and j < C rows of w (stride K), R <= MR, C <= NR;
// prefetches C rows of K floats at `next` along the way.
template <int64_t R, int64_t C>
void tile(const float* x, int64_t sx, const float* w, int64_t K, const float* bias, float* out,
          int64_t so, const char* next) {
  vfloat acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) acc[i][j] = vfloat{};
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    for (int64_t j = 0; j < C; ++j) __builtin_prefetch(next + (j * K + k) * sizeof(float), 0, 1);
    vfloat xv[R];
    for (int64_t i = 0; i < R; ++i) xv[i] = load(x + i * sx + k);
    for (int64_t j = 0; j < C; ++j) {
      const vfloat wv = load(w + j * K + k);
      for (int64_t i = 0; i < R; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {
    vfloat xv[R];
    for (int64_t i = 0; i < R; ++i) xv[i] = load_tail(x + i * sx + k, K - k);
    for (int64_t j = 0; j < C; ++j) {
      const vfloat wv = load_tail(w + j * K + k, K - k);
      for (int64_t i = 0; i < R; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) {
      const float dot = reduce(acc[i][j], plus);
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
