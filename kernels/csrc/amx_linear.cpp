// A bfloat16 matmul on AMX tiles (Intel Xeons from Sapphire Rapids on), reading the weights in
// bf16_vnni_pack's layout (vnni_linear.cpp), so one packed copy serves both kernels:
//
//   bf16_amx_supported() -> whether this build has AMX and the OS lends this process tile state
//   bf16_amx_linear(x (M, K), packed, N, bias (N,) | None) -> x @ weight.T + bias  (M, N), K % 32 == 0
//
// Why: vnni_linear's dot products run at ~75 GFLOP/s on an AMX Xeon's two cores (a quarter of
// what the same kernel reaches on an AVX-512 BF16 EPYC), so from ~8 rows on oneDNN's AMX GEMM
// took over, and it needs a second packed copy of every weight, reordered into fresh memory by
// every weight update. One tile multiply here does 16 x 16 x 32 multiply-adds.
//
// The packed panel is AMX's B operand as it is: a k pair of 32 columns is 128 contiguous bytes,
// so a 16-pair x 16-column B tile is 16 rows of 64 bytes at a stride of 128 (the panel's left
// half; +64 bytes for the right half). x rows are the A operand (16 rows x 32 k at x's row
// stride). Tiles: C 0-3 (two 16-row blocks x two 16-column halves), A 4-5, B 6-7. Sums run in
// float32 inside the tile (products exact; AMX treats bf16 denormals as zero, as
// vdpbf16ps does), the bias is added in float32 and each output rounded to bf16 once (nearest
// even): F.linear's result up to the order of the float32 sums.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define ROLLOUT_AMX 1
#endif

#include "ops.h"

namespace rollout_amx {

constexpr int64_t kPanel = 32;  // bf16_vnni_pack's panel width
// In a group's first pass over its panels, each block of 16 k pairs prefetches (into L2) the 2 KB
// of the weight stream this far ahead of it: a decode step is a stream of weights from memory,
// and without it the tiles waited (1-16 rows of the default model's 121 matmuls: 16-18 -> 12-13
// ms, the pace of vnni_linear's own prefetch schedule; 4-16 KB ahead all alike). Later passes
// find the group in L2 and prefetch nothing (at 128 rows 3-15% faster than prefetching in every
// pass, interleaved). Past the end of a run it fetches lines nobody reads, which costs nothing.
constexpr int64_t kPrefetchAhead = 8192;

bool bf16_amx_supported() {
#if ROLLOUT_AMX
  // Linux lends a process AMX's tile state only on request (5.16+); without it the first tile
  // instruction is a SIGILL. The grant covers every thread of the process.
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

#if ROLLOUT_AMX
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles for a block of r0 (A0, C0, C1) + r1 (A1, C2, C3; 0: no second block) rows of x.
void configure(int64_t r0, int64_t r1) {
  TileConfig c;
  const int64_t rows[8] = {r0, r0, r1, r1, r0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = rows[t] ? 64 : 0;
  }
  _tile_loadconfig(&c);
}

// c[i, 0:32] (row stride 32 floats) = x rows [0, r0 + r1) . panel, for K / 32 blocks of 16 k pairs.
template <bool kTwo, bool kPrefetch>
inline void block(const uint16_t* x, int64_t sx_bytes, int64_t K, const uint16_t* w, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* x1 = reinterpret_cast<const uint16_t*>(reinterpret_cast<const char*>(x) + 16 * sx_bytes);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint16_t* wk = w + kb * 16 * 2 * kPanel;  // 16 k pairs x 32 columns x 2
    if constexpr (kPrefetch) {
      const char* pf = reinterpret_cast<const char*>(wk) + kPrefetchAhead;
      for (int64_t i = 0; i < 2048; i += 64) _mm_prefetch(pf + i, _MM_HINT_T1);
    }
    _tile_loadd(6, wk, 128);
    _tile_loadd(7, wk + 32, 128);
    _tile_loadd(4, x + kb * 32, sx_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, x1 + kb * 32, sx_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if constexpr (kTwo) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// out rows [0, rows), columns [0, cols) = c + bias, rounded to bf16.
inline void finish(const float* c, int64_t rows, int64_t cols, const float* bias, c10::BFloat16* out, int64_t so) {
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t n = std::min<int64_t>(16, cols - 16 * half);
    if (n <= 0) break;
    const __mmask16 mask = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * half) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i)
      _mm256_mask_storeu_epi16(out + i * so + 16 * half, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(c + i * 32 + 16 * half), b)));
  }
}

}  // namespace
#endif

at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const std::optional<at::Tensor>& bias) {
#if ROLLOUT_AMX
  TORCH_CHECK(bf16_amx_supported(), "bf16_amx_linear: this process may not use AMX tiles (see bf16_amx_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  (x.size(1) <= 1 || x.stride(1) == 1),
              "bf16_amx_linear: x must be a bfloat16 (M, K) CPU tensor with a contiguous last dim");
  const int64_t M = x.size(0), K = x.size(1), NP = (N + kPanel - 1) / kPanel, KP = K / 2;
  TORCH_CHECK(K % 32 == 0, "bf16_amx_linear: K must be a multiple of 32 (bf16_vnni_linear takes the others)");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({NP, KP, kPanel, 2}),
              "bf16_amx_linear: packed must come from bf16_vnni_pack of an (", N, ", ", K, ") weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_amx_linear: bias must be (N,)");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::Tensor(at::detail::empty_cpu({M, N}, at::kBFloat16));
  if (M == 0 || N == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t sx = x.stride(0), sx_bytes = sx * 2, panel = KP * 2 * kPanel;
  // Blocks of 32 rows (two A tiles); the last block holds what is left (one tile when <= 16).
  // Panels go in groups that stay in L2 while every row block passes under them (prefill), and a
  // row block stays in L1/L2 across its group; a decode step of <= 32 rows is one block, each
  // panel read once from memory.
  const int64_t full = M / 32, rest = M % 32;
  const int64_t group = std::max<int64_t>(1, (512 << 10) / (panel * 2));
  auto run = [&](int64_t p0, int64_t p1) {
    alignas(64) float c[32 * 32];
    int64_t shape = -1;  // the configured block: 32 (full) or `rest`
    auto use = [&](int64_t rows) {
      if (shape != rows) configure(std::min<int64_t>(rows, 16), rows > 16 ? rows - 16 : 0);
      shape = rows;
    };
    for (int64_t g = p0; g < p1; g += group) {
      const int64_t g1 = std::min(p1, g + group);
      for (int64_t b = 0; b <= full; ++b) {
        const int64_t rows = b < full ? 32 : rest;
        if (rows == 0) break;
        use(rows);
        const uint16_t* xb = xp + b * 32 * sx;
        for (int64_t p = g; p < g1; ++p) {
          const uint16_t* w = wp + p * panel;
          if (b == 0) {
            if (rows > 16) block<true, true>(xb, sx_bytes, K, w, c);
            else block<false, true>(xb, sx_bytes, K, w, c);
          } else {
            if (rows > 16) block<true, false>(xb, sx_bytes, K, w, c);
            else block<false, false>(xb, sx_bytes, K, w, c);
          }
          finish(c, rows, std::min<int64_t>(kPanel, N - p * kPanel), bp ? bp + p * kPanel : nullptr,
                 op + b * 32 * N + p * kPanel, N);
        }
      }
    }
    _tile_release();
  };
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, NP * panel * 2 / (1 << 16)));
  if (threads <= 1) run(0, NP);
  else at::parallel_for(0, NP, (NP + threads - 1) / threads, run);
  return out;
#else
  TORCH_CHECK(false, "bf16_amx_linear: not built with AMX (see bf16_amx_supported)");
#endif
}

}  // namespace rollout_amx
