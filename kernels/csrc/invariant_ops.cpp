// Batch-invariant float32 matmul on the plain (unpacked) weight:
//
//   invariant_linear(x (M, K), weight (N, K), bias (N,) | None) -> x @ weight.T + bias  (M, N)
//
// BLAS libraries pick their blocking, kernels and threading by M (a decode of 3 sequences and a
// prefill of 300 tokens take different code), so a row's result depends on what else is in the
// batch. Here every output element is one chain of FMAs over k = 0, 1, ..., K - 1 from zero, then
// + bias (+ 0 without one): the order of f32_panel_linear (f32_linear.cpp), which batch-invariant
// mode runs on its packed weights where it is built (AVX-512 or AVX2 + FMA). This op gives the
// same bits without a packed copy and on any CPU, so a CPU without the panels, or a few-row step
// on one that takes oneDNN for larger ones, agrees with them bit for bit. Tiles, blocks and
// threads only decide which outputs are computed together, never how one is computed.
//
// How: the outputs are taken in blocks of 2 vectors of columns; a block's weight rows are
// transposed into a k-major buffer (the panel layout, made per call) and each tile of up to MR
// rows of x then takes two weight loads and 2 * MR FMAs per k with x[k] broadcast. Threads split
// the column blocks.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace rollout_invariant {
namespace {

using rollout_vec::L;
using rollout_vec::load;
using rollout_vec::store;
using rollout_vec::vfloat;

constexpr int64_t kCols = 2 * L;  // output columns per block: two vectors
// Rows of x per register tile: 2 * MR accumulators, two weight vectors and a broadcast in the
// target's registers (32 with AVX-512, 16 with AVX2).
#if defined(__AVX512F__)
constexpr int64_t MR = 12;
#else
constexpr int64_t MR = 6;
#endif
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

// x in every lane (not vec.h's splat: 0 + x turns -0 into +0, and GCC builds it through memory).
inline vfloat broadcast(const float* x) {
#if defined(__AVX512F__)
  return (vfloat)_mm512_set1_ps(*x);
#elif defined(__AVX__)
  return (vfloat)_mm256_broadcast_ss(x);
#else
  vfloat r;
  for (int64_t l = 0; l < L; ++l) r[l] = *x;
  return r;
#endif
}

// out[i, 0:cols] for i < R rows of x (stride sx) from a block's k-major weights wt (K x kCols).
// The loops over the accumulators are unrolled by pragma: left to itself GCC keeps them on the
// stack (see f32_linear.cpp).
template <int64_t R>
void tile(const float* x, int64_t sx, int64_t K, const float* wt, const float* bias, int64_t cols, float* out,
          int64_t so) {
  vfloat acc[R][2];
#pragma GCC unroll 16
  for (int64_t i = 0; i < R; ++i) acc[i][0] = acc[i][1] = vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    const vfloat w0 = load(wt + k * kCols), w1 = load(wt + k * kCols + L);
#pragma GCC unroll 16
    for (int64_t i = 0; i < R; ++i) {
      const vfloat xv = broadcast(x + i * sx + k);
      acc[i][0] = fma(xv, w0, acc[i][0]);
      acc[i][1] = fma(xv, w1, acc[i][1]);
    }
  }
  alignas(64) float buf[R][kCols];
#pragma GCC unroll 16
  for (int64_t i = 0; i < R; ++i) store(buf[i], acc[i][0]), store(buf[i] + L, acc[i][1]);
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < cols; ++c) out[i * so + c] = buf[i][c] + (bias ? bias[c] : 0.0f);
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, int64_t, float*, int64_t);
template <int64_t... Rs>
constexpr std::array<TileFn, MR> make_tiles(std::integer_sequence<int64_t, Rs...>) {
  return {&tile<Rs + 1>...};
}
constexpr std::array<TileFn, MR> kTiles = make_tiles(std::make_integer_sequence<int64_t, MR>{});

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
  const int64_t blocks = (N + kCols - 1) / kCols;
  auto run = [&](int64_t b0, int64_t b1) {
    std::vector<float> wt(K * kCols);  // one block's weights, k-major (zeros past N)
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n = blk * kCols, cols = std::min(kCols, N - n);
      for (int64_t c = 0; c < cols; ++c)
        for (int64_t k = 0; k < K; ++k) wt[k * kCols + c] = wp[(n + c) * K + k];
      if (cols < kCols)  // the last block: its columns past N stay zero
        for (int64_t k = 0; k < K; ++k) std::fill_n(&wt[k * kCols + cols], kCols - cols, 0.0f);
      for (int64_t m = 0; m < M; m += MR) {
        const int64_t R = std::min(MR, M - m);
        kTiles[R - 1](xp + m * sx, sx, K, wt.data(), b ? b + n : nullptr, cols, op + m * N + n, N);
      }
    }
  };
  const int64_t fmas_per_block = std::max<int64_t>(1, M * kCols * K);
  if (blocks * fmas_per_block < kParallelFmas || at::get_num_threads() == 1) run(0, blocks);
  else at::parallel_for(0, blocks, std::max<int64_t>(1, kParallelFmas / fmas_per_block), run);
  return out;
}

}  // namespace rollout_invariant
