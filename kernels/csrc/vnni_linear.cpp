// A bfloat16 matmul for decode steps (up to a few dozen rows), on CPUs with AVX-512 BF16:
//
//   bf16_vnni_pack(weight (N, K), out=None) -> packed (ceil(N/32), ceil(K/2), 32, 2) bf16
//     (into `out` when given: a weight update repacks into the memory it packed before, since
//     fresh pages cost the engine several times a copy in page faults)
//   bf16_vnni_linear(x (M, K), packed, N, bias (N,) | None) -> x @ weight.T + bias  (M, N)
//
// In a decode step a projection is a read of its weights plus M * N * K multiply-adds, and at
// 8-32 rows the two take about as long: the kernel must overlap them. The weights are packed
// so one 64-byte load holds a pair of k values for 16 output columns (the dot-product
// instruction's operand layout): a register tile of up to 8 rows x 32 columns takes two weight
// loads and 16 dot products (x's k pair broadcast from memory) per k pair, with no horizontal
// sums. Each thread streams a contiguous run of 32-column panels once (every row chunk of x
// passes under a panel while it is in L1/L2) and prefetches ahead of the stream (see `run`: the
// schedule is worth 10-15% at 1-64 rows). Sums run in float32, the bias is added in float32 and
// each output is rounded to bf16 once (nearest even): F.linear's result up to the order of the
// float32 sums.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define ROLLOUT_VNNI_BF16 1
#endif

#include "bf16_round.h"
#include "ops.h"
#include "pack_ahead.h"

namespace rollout_vnni {

constexpr int64_t kPanel = 32;  // output columns per packed panel: two 16-float accumulators

bool bf16_vnni_supported() {
#if ROLLOUT_VNNI_BF16
  return true;
#else
  return false;
#endif
}

#if ROLLOUT_VNNI_BF16
// A 16 x 16 block of 32-bit values (k pairs) transposed in registers: rows in r, columns out.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: a0 b0 a1 b1 / a2 b2 a3 b3
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[4g + m], lane L: rows 4g..4g+3 at column 4L + m
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int m = 0; m < 4; ++m) {  // column 4L + m: lane L of r[m], r[4 + m], r[8 + m], r[12 + m]
    const __m512i ab02 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0x88), ab13 = _mm512_shuffle_i32x4(r[m], r[4 + m], 0xdd);
    const __m512i cd02 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0x88),
                  cd13 = _mm512_shuffle_i32x4(r[8 + m], r[12 + m], 0xdd);
    t[m] = _mm512_shuffle_i32x4(ab02, cd02, 0x88);
    t[4 + m] = _mm512_shuffle_i32x4(ab13, cd13, 0x88);
    t[8 + m] = _mm512_shuffle_i32x4(ab02, cd02, 0xdd);
    t[12 + m] = _mm512_shuffle_i32x4(ab13, cd13, 0xdd);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}
#endif

namespace {

// a source row's 32 values from k on as bf16 (a float32 one rounded as torch's cast rounds), and one value
#if ROLLOUT_VNNI_BF16
inline __m512i load32(const uint16_t* row) { return _mm512_loadu_si512(row); }
inline __m512i load32(const float* row) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(rollout_bf16::round16(_mm512_loadu_si512(row))),
                            rollout_bf16::round16(_mm512_loadu_si512(row + 16)), 1);
}
#endif
inline uint16_t bits(uint16_t v) { return v; }
inline uint16_t bits(float v) { return rollout_bf16::round_bits(v); }

template <typename T>
void pack_panels(const T* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
  const int64_t KP = (K + 1) / 2;
  // Columns past N and the k past an odd K are zeros. With AVX-512 a full panel's first
  // 16 * (K / 32) k pairs go as 16 x 16 register transposes of k pairs (a weight update repacks
  // every projection: the scalar loop alone cost about as much as the rest), each 16 rows through
  // all of K on their own: a transposed row is a whole cache line of the panel, streamed out, and
  // 16 rows read side by side instead of 32 kept the pack near a copy's speed (1.8x slower else).
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kPanel, N - p * kPanel);
    const T* rows = src + p * kPanel * ld;
    uint16_t* d = dst + p * KP * kPanel * 2;
    int64_t kp = 0;
#if ROLLOUT_VNNI_BF16
    const bool aligned = reinterpret_cast<uintptr_t>(dst) % 64 == 0;
    if (cols == kPanel) {
      __m512i r[16];
      const int64_t blocks = K / 32;  // of 16 k pairs
      rollout_pack::PanelAhead ahead(src, sizeof(T), N, K, ld, p, p1, 2 * blocks);
      for (int64_t h = 0; h < 2; ++h) {
        for (int64_t b = 0; b < blocks; ++b) {
          ahead.step();
          uint16_t* db = d + b * 16 * kPanel * 2 + h * 32;
          for (int64_t i = 0; i < 16; ++i) {
            const T* row = rows + (h * 16 + i) * ld + 32 * b;
            r[i] = load32(row);
            __builtin_prefetch(reinterpret_cast<const char*>(row) + 256);
          }
          transpose16(r);
          if (aligned) {  // streamed: the packed copy is not read again soon, and a store that
            for (int64_t j = 0; j < 16; ++j)  // skips the cache skips reading the line first
              _mm512_stream_si512(reinterpret_cast<__m512i*>(db + j * kPanel * 2), r[j]);
          } else {
            for (int64_t j = 0; j < 16; ++j) _mm512_storeu_si512(db + j * kPanel * 2, r[j]);
          }
        }
      }
      kp = blocks * 16;
      d += blocks * 16 * kPanel * 2;
    }
#endif
    for (; kp < KP; ++kp, d += kPanel * 2) {  // (the rest: scalar)
      const int64_t k = 2 * kp;
      for (int64_t c = 0; c < cols; ++c) {
        d[2 * c] = bits(rows[c * ld + k]);
        d[2 * c + 1] = k + 1 < K ? bits(rows[c * ld + k + 1]) : 0;
      }
      if (cols < kPanel) std::memset(d + 2 * cols, 0, (kPanel - cols) * 4);
    }
  }
#if ROLLOUT_VNNI_BF16
  _mm_sfence();  // the streamed stores are visible before the pack returns
#endif
}

}  // namespace

void vnni_pack_panels(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
  pack_panels(src, dst, N, K, ld, p0, p1);
}

void vnni_pack_panels(const float* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1) {
  pack_panels(src, dst, N, K, ld, p0, p1);
}

at::Tensor bf16_vnni_pack(const at::Tensor& weight, const std::optional<at::Tensor>& out) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "bf16_vnni_pack: a bfloat16 (N, K) CPU tensor");
  const at::Tensor w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NP = (N + kPanel - 1) / kPanel, KP = (K + 1) / 2;
  at::Tensor packed;
  if (out.has_value()) {
    packed = *out;
    TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                    packed.sizes() == at::IntArrayRef({NP, KP, kPanel, 2}),
                "bf16_vnni_pack: out must be a contiguous bfloat16 (", NP, ", ", KP, ", ", kPanel, ", 2) CPU tensor");
  } else {
    packed = at::empty({NP, KP, kPanel, 2}, w.options());
  }
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>());
  at::parallel_for(0, NP, 1, [&](int64_t p0, int64_t p1) { vnni_pack_panels(src, dst, N, K, K, p0, p1); });
  return packed;
}


#if ROLLOUT_VNNI_BF16
namespace {

constexpr int64_t MR = 8;  // rows of x per register tile (x 32 columns: 16 accumulators)
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of itself a lone pass over a panel prefetches

// out[i, 0:cols] for i < R rows of x (row stride sx) from one panel (KP k pairs x 32 columns,
// 128 contiguous bytes per k pair); cols <= 32 counts its valid columns. Each k pair also
// prefetches pf + kp * pf_step (and the next line when the step is 128 bytes), into L2 only when
// kL2 (the fast rate of one or two passes a panel: L1's miss buffers would fill and stall).
template <int64_t R, bool kL2>
void tile(const uint16_t* x, int64_t sx, int64_t K, const uint16_t* w, const float* bias, int64_t cols,
          c10::BFloat16* out, int64_t so, const char* pf, int64_t pf_step) {
  __m512 acc[R][2];
  for (int64_t i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const int64_t pairs = (K + 1) / 2;
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const uint16_t* wk = w + kp * 2 * kPanel;
    const __m512i w0 = _mm512_loadu_si512(wk), w1 = _mm512_loadu_si512(wk + 32);
    if constexpr (kL2) {
      __builtin_prefetch(pf + kp * pf_step, 0, 1);
      if (pf_step > 64) __builtin_prefetch(pf + kp * pf_step + 64, 0, 1);
    } else {
      __builtin_prefetch(pf + kp * pf_step);
      if (pf_step > 64) __builtin_prefetch(pf + kp * pf_step + 64);
    }
    const bool last_alone = 2 * kp + 1 == K;  // odd K: the packed panel holds a zero beside it
    for (int64_t i = 0; i < R; ++i) {
      int32_t pair = 0;
      if (last_alone) pair = x[i * sx + 2 * kp];
      else std::memcpy(&pair, x + i * sx + 2 * kp, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, (__m512bh)w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, (__m512bh)w1);
    }
  }
  for (int64_t half = 0; half < 2; ++half) {
    const int64_t c = std::min<int64_t>(16, cols - 16 * half);
    if (c <= 0) break;
    const __mmask16 mask = c >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << c) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * half) : _mm512_setzero_ps();
    for (int64_t i = 0; i < R; ++i)
      _mm256_mask_storeu_epi16(out + i * so + 16 * half, mask,
                               (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[i][half], b)));
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, int64_t, const uint16_t*, const float*, int64_t,
                        c10::BFloat16*, int64_t, const char*, int64_t);
template <bool kL2, int64_t... Rs>
constexpr std::array<TileFn, MR> make_tiles(std::integer_sequence<int64_t, Rs...>) {
  return {&tile<Rs + 1, kL2>...};
}
constexpr std::array<TileFn, MR> kTiles[2] = {make_tiles<false>(std::make_integer_sequence<int64_t, MR>{}),
                                              make_tiles<true>(std::make_integer_sequence<int64_t, MR>{})};

}  // namespace
#endif

at::Tensor bf16_vnni_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const std::optional<at::Tensor>& bias) {
#if ROLLOUT_VNNI_BF16
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
                  (x.size(1) <= 1 || x.stride(1) == 1),
              "bf16_vnni_linear: x must be a bfloat16 (M, K) CPU tensor with a contiguous last dim");
  const int64_t M = x.size(0), K = x.size(1), sx = x.stride(0), NP = (N + kPanel - 1) / kPanel, KP = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.sizes() == at::IntArrayRef({NP, KP, kPanel, 2}),
              "bf16_vnni_linear: packed must come from bf16_vnni_pack of an (", N, ", ", K, ") weight");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "bf16_vnni_linear: bias must be (N,)");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  at::Tensor out = at::Tensor(at::detail::empty_cpu({M, N}, at::kBFloat16));
  if (M == 0 || N == 0) return out;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t panel = KP * 2 * kPanel;  // bf16 elements per panel
  // The prefetch schedule: a panel takes `passes` passes (one per MR rows of x). With one pass
  // (decode of <= 8 rows: a pure weight stream) each k pair prefetches 4 KB ahead of itself. With
  // several, the panel is already in cache after pass 0, so pass j prefetches the j-th slice of
  // the thread's next panel: the next panel's weights arrive while this one's arithmetic runs
  // (at 32 rows the weight stream had been ~5 ms of a 26 ms step on top of the arithmetic). A
  // thread's first panel prefetches ahead of itself on pass 0. (Past 128 passes, i.e. prefill,
  // a slice is under a line and slice_step is 0: each pass fetches the line of its slice.)
  const int64_t passes = (M + MR - 1) / MR, panel_bytes = panel * 2, slice_step = 128 / passes;
  auto run = [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(kPanel, N - p * kPanel);
      const char* here = reinterpret_cast<const char*>(wp + p * panel);
      for (int64_t m = 0, j = 0; m < M; m += MR, ++j) {
        const int64_t R = std::min(MR, M - m);
        const bool ahead = passes == 1 || (j == 0 && p == p0);
        const char* pf = ahead ? here + kPrefetchBytes
                         : p + 1 < p1 ? here + panel_bytes + j * panel_bytes / passes
                         : here;  // a thread's last panel: nothing of its own left to fetch
        kTiles[passes <= 2][R - 1](xp + m * sx, sx, K, wp + p * panel, bp ? bp + p * kPanel : nullptr, cols,
                                   op + m * N + p * kPanel, N, pf, ahead ? 128 : slice_step);
      }
    }
  };
  // Each thread takes one contiguous run of panels (one stream); a small matrix stays on one thread.
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), std::max<int64_t>(1, NP * panel * 2 / (1 << 16)));
  if (threads <= 1) run(0, NP);
  else at::parallel_for(0, NP, (NP + threads - 1) / threads, run);
  return out;
#else
  TORCH_CHECK(false, "bf16_vnni_linear: this CPU has no AVX-512 BF16 (see bf16_vnni_supported)");
#endif
}

}  // namespace rollout_vnni
