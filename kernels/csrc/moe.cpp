// The routed experts of a mixture-of-experts layer in one call (float32 and bfloat16):
//
//   fused_experts(x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_ids (T, k), topk_weights (T, k))
//     -> (T, H): out[t] = sum over t's experts e, in ascending e, of
//                w(t, e) * down_e(silu(gate_e x[t]) * up_e x[t])
//
// (kernels/moe.py states the contract; fused_experts_torch there is the reference.) At decode
// sizes an MoE layer is a read of its active experts' weights (Qwen3-30B-A3B: 8 experts x 18 MB
// of float32 per token), so the kernel is built around streaming each active expert's weights
// once per call, whatever the number of its tokens:
//
//   1. route: the (token, slot) pairs sorted by expert, then token (a counting sort);
//   2. gate_up: threads split the I intermediate columns; each walks the active experts in id
//      order and, for each, streams its share of the gate and up rows once under all the
//      expert's tokens, then applies silu(gate) * up to them (act: pairs x I floats);
//   3. down: threads split the H output columns; each walks the active experts in id order,
//      streams its share of the down rows under the expert's tokens and adds each weighted
//      result into the token's output row. A thread owns its output columns, and the expert
//      loop runs in ascending id, so every token's sum runs in ascending expert id from zero,
//      as transformers' loop over experts (index_add_) does: no atomics, no per-pair buffer of
//      (T * k, H) outputs, and the result does not depend on the order of tokens in the batch.
//
// Two parallel regions per call (one barrier between gate_up and down); each thread's weights
// are contiguous runs of rows, and each block of rows prefetches the next one (into L2) while
// its arithmetic runs. Each output element is one dot product computed the same way wherever
// its token sits (lane l of a vector accumulator takes k = l, l + VL, ... with one FMA each -- for
// bf16 weights in the even/odd order described at slot() -- and the lanes are summed by a fixed
// tree; tiles only decide which outputs are computed together): a token's output is bitwise the
// same alone or in any batch (batch-invariant), which torch's matmuls do not promise. Calls of
// more than kMaxPairs pairs run their tokens in chunks (bounded scratch; same bits).
//
// Rounding points follow the reference's torch ops: in bfloat16 the gate and up outputs, silu's
// result, its product with up, the down output, its product with the weight (cast to bf16 first)
// and each running sum of the index_add_ are rounded to bf16 (nearest even), the dot products
// themselves run in float32. In float32 the reference's separate products and sums are kept
// un-fused (keep()). So results differ from the reference by the order of the matmuls' float32
// sums only (and silu's exp: SLEEF's expf_u10 algorithm, what ATen's vectorized silu calls).
//
// Vectors are the CPU's native width (8 floats on AVX2, 16 on AVX-512), not vec.h's 16 lanes:
// on AVX2 a 16-lane vector takes two of the 16 ymm registers and would halve the register tile.
// bf16 weights are widened to float32 in registers. (No AVX-512 BF16 dot-product path yet: it
// would want the expert weights prepacked at load in bf16_vnni_linear's layout.)
//
// Declared in ops.h, bound to Python in bindings.cpp.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#include "ops.h"

namespace rollout_moe {
namespace {

using bf16 = c10::BFloat16;

// Register tiles: R <= MR token rows x C weight rows, one accumulator each. An FMA's result is
// ready ~4-5 cycles later and two issue per cycle, so a tile needs ~10 independent accumulators
// to keep them busy: an expert with fewer token rows gets wider tiles (kCols[R - 1] weight rows;
// at decode, one token per expert, 3 rows had left the bf16 kernel at half speed).
#if defined(__AVX512F__)
constexpr int64_t VL = 16;  // floats per vector register
constexpr int64_t MR = 4;
constexpr int64_t kCols[MR] = {12, 8, 6, 5};  // of 32 zmm registers
#else
constexpr int64_t VL = 8;
constexpr int64_t MR = 3;  // (4 x 3 tiles left GCC one register short: 1.3 loads per FMA, ~13% slower)
constexpr int64_t kCols[MR] = {8, 6, 4};  // of 16 ymm registers (accumulators, x rows, a weight row)
#endif
constexpr int64_t NR = kCols[0];  // the widest tile
constexpr int64_t kParallelFmas = 1 << 18;  // below this many multiply-adds a call stays on one thread
constexpr int64_t kMaxPairs = 8192;  // (token, expert) pairs per pass: bounds the scratch

typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));
typedef float vf_mem __attribute__((vector_size(4 * VL), aligned(4), may_alias));
typedef uint16_t vh_mem __attribute__((vector_size(2 * VL), aligned(2), may_alias));

inline vf splat(float x) { return vf{} + x; }
inline vf load(const float* p) { return *reinterpret_cast<const vf_mem*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_mem*>(p) = v; }
inline vf load(const bf16* p) {  // bf16 -> f32: widen and shift
#if defined(__AVX512F__)  // (GCC splits the generic convertvector into 256-bit halves)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#elif defined(__AVX2__)  // (GCC's generic convertvector: four shuffles where one does)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
#else
  return (vf)(__builtin_convertvector(*reinterpret_cast<const vh_mem*>(p), vu) << 16);
#endif
}
template <typename T>
inline vf load_n(const T* p, int64_t n) {  // n < VL elements, the other lanes 0
  T tmp[VL];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, n * sizeof(T));
  return load(tmp);
}

// acc + a * b with one rounding, spelled out: every output must see the same operation sequence
// whichever tile computes it.
inline vf fma(vf a, vf b, vf acc) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)acc);
#elif defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)acc);
#else
  vf r;
  for (int64_t l = 0; l < VL; ++l) r[l] = __builtin_fmaf(a[l], b[l], acc[l]);
  return r;
#endif
}

// The sum of a vector's lanes by a fixed tree (lanes i and i + VL/2, then i and i + VL/4, ...).
inline float hsum(vf v) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 a;
  if constexpr (VL == 16) {
    a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
        __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  } else {
    std::memcpy(&a, &v, sizeof(a));
  }
  typedef float v4 __attribute__((vector_size(16)));
  const v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// Materializes a float32 value: GCC contracts a*b+c into an FMA by default, which would skip a
// rounding that torch, computing a*b in a separate kernel, does.
#if defined(__x86_64__) && defined(__AVX512F__)
inline vf keep(vf x) { asm("" : "+v"(x)); return x; }
#elif defined(__x86_64__) && defined(__AVX__)
inline vf keep(vf x) { asm("" : "+x"(x)); return x; }
#else
inline vf keep(vf x) { asm("" : "+m"(x)); return x; }
#endif
#if defined(__x86_64__)
inline float keep(float x) { asm("" : "+x"(x)); return x; }
#else
inline float keep(float x) { asm("" : "+m"(x)); return x; }
#endif

inline vf bf16_round(vf v) {  // f32 -> the nearest-even bf16 value, as f32 (like c10::BFloat16)
  const vu u = (vu)v, rounded = (u + ((u >> 16) & 1) + 0x7FFF) & 0xFFFF0000u;
  return (vf)(v != v ? vu{} + 0x7FC00000u : rounded);  // NaN -> canonical quiet NaN
}
// The value of a float32 result once stored in T (float32 itself, kept un-fused).
template <typename T>
inline vf round_to(vf v) {
  if constexpr (std::is_same_v<T, float>) return keep(v);
  else return bf16_round(v);
}
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) return keep(v);
  else return static_cast<float>(static_cast<bf16>(v));
}

// exp(x) by SLEEF's expf_u10 algorithm (ATen's vectorized exp; fused_ops.cpp's sleef_expf at this
// file's vector width): Cody-Waite reduction by ln 2 and a degree-6 polynomial.
inline vf sleef_expf(vf d) {
  const vf t = keep(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
  const vf qf = (t + 12582912.0f) - 12582912.0f;  // rint (ties to even), |t| < 2^22
  const vi q = __builtin_convertvector(qf, vi);
  vf s = d - qf * 0.693145751953125f;  // fma
  s = s - qf * 1.428606765330187045e-06f;  // fma
  vf u = splat(0.000198527617612853646278381f);
  u = u * s + 0.00139304355252534151077271f;  // each an fma
  u = u * s + 0.00833336077630519866943359f;
  u = u * s + 0.0416664853692054748535156f;
  u = u * s + 0.166666671633720397949219f;
  u = u * s + 0.5f;
  u = 1.0f + (keep(s * s) * u + s);
  const vi q1 = q >> 1, q2 = q - q1;  // ldexp in two steps: 2^q1 * 2^q2
  u = keep(u * (vf)((q1 + 127) << 23)) * (vf)((q2 + 127) << 23);
  u = (vf)((vi)u & ~(vi)(d < -104.0f));
  u = 100.0f < d ? splat(__builtin_inff()) : u;
  return (vf)((vi)u | (vi)(d != d));
}

// ---- the register tile ----------------------------------------------------------------------

// bf16 weights are widened two vectors at a time: one load of 2 * VL bf16 holds, in each 32-bit
// lane l, elements 2l (low half) and 2l + 1 (high half); a shift and a mask make them float32
// vectors of the even and the odd elements (two cheap ALU ops where a widening load costs a
// shuffle and a shift per vector). The float32 rows they multiply are stored with each block of
// 2 * VL elements split the same way (evens, then odds: see slot()); a row's last K % (2 * VL)
// elements stay in order and are widened one vector at a time.
template <typename W>
constexpr int64_t kBlock = std::is_same_v<W, bf16> ? 2 * VL : 1;
// Where element c of a K-element float32 row goes in the layout the tiles read for W weights.
template <typename W>
inline int64_t slot(int64_t c, int64_t K) {
  constexpr int64_t B = kBlock<W>;
  if (B == 1 || c >= K - K % B) return c;
  const int64_t r = c % B;
  return c - r + (r % 2) * VL + r / 2;
}
typedef uint32_t vu_mem __attribute__((vector_size(4 * VL), aligned(2), may_alias));

// res[i * C + j] = dot(x[i][0:K], w[j * K : (j + 1) * K]) for i < R token rows (pointers, in
// slot<W>() layout) and j < C consecutive weight rows. With pf, it also prefetches the C rows at
// pf into L2 along the way (the next block of weights: its memory reads overlap this block's
// arithmetic).
template <int64_t R, int64_t C, typename W>
void tile(const float* const* x, const W* w, int64_t K, float* res, const W* pf) {
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  vf acc[R][C];
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) acc[i][j] = vf{};
  int64_t k = 0;
  if constexpr (std::is_same_v<W, bf16>) {
    for (; k + 2 * VL <= K; k += 2 * VL) {
      if (pf && k % kLine == 0)
        for (int64_t j = 0; j < C; ++j) __builtin_prefetch(pf + j * K + k, 0, 2);
      for (int64_t j = 0; j < C; ++j) {
        const vu raw = *reinterpret_cast<const vu_mem*>(w + j * K + k);
        const vf even = (vf)(raw << 16), odd = (vf)(raw & 0xFFFF0000u);
        for (int64_t i = 0; i < R; ++i) {
          acc[i][j] = fma(load(x[i] + k), even, acc[i][j]);
          acc[i][j] = fma(load(x[i] + k + VL), odd, acc[i][j]);
        }
      }
    }
  }
  for (; k + VL <= K; k += VL) {
    if (pf && k % kLine == 0)
      for (int64_t j = 0; j < C; ++j) __builtin_prefetch(pf + j * K + k, 0, 2);
    vf xv[R];
    for (int64_t i = 0; i < R; ++i) xv[i] = load(x[i] + k);
    for (int64_t j = 0; j < C; ++j) {
      const vf wv = load(w + j * K + k);
      for (int64_t i = 0; i < R; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  if (k < K) {  // a zero-padded last vector: the same lanes as in a row of any length
    vf xv[R];
    for (int64_t i = 0; i < R; ++i) xv[i] = load_n(x[i] + k, K - k);
    for (int64_t j = 0; j < C; ++j) {
      const vf wv = load_n(w + j * K + k, K - k);
      for (int64_t i = 0; i < R; ++i) acc[i][j] = fma(xv[i], wv, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t j = 0; j < C; ++j) res[i * C + j] = hsum(acc[i][j]);
}

template <typename W>
using TileFn = void (*)(const float* const*, const W*, int64_t, float*, const W*);
template <typename W, int64_t R, int64_t... Cs>
constexpr auto tile_row(std::integer_sequence<int64_t, Cs...>) {
  return std::array<TileFn<W>, NR>{&tile<R, Cs + 1, W>...};
}
template <typename W, int64_t... Rs>
constexpr auto tile_table(std::integer_sequence<int64_t, Rs...>) {
  return std::array<std::array<TileFn<W>, NR>, MR>{tile_row<W, Rs + 1>(std::make_integer_sequence<int64_t, NR>{})...};
}
// kTiles<W>[R - 1][C - 1] = tile<R, C, W>: the full tile and every edge tile.
template <typename W>
constexpr auto kTiles = tile_table<W>(std::make_integer_sequence<int64_t, MR>{});

// For weight rows [j0, j1) of w (K each) and n token rows x[0:n]: epi(p, R, j, C, res) with the
// R x C dot products of rows p.. and weight rows j.. . Each block of weight rows stays in cache
// while all n token rows pass under it: the weights are read from memory once. The first pass
// over a block prefetches the next one, the last block the rows at `then` (the caller's next
// stream, or nullptr).
template <typename W, typename Epi>
void gemm(const float* const* x, int64_t n, const W* w, int64_t K, int64_t j0, int64_t j1, const W* then,
          const Epi& epi) {
  float res[MR * NR];
  const int64_t cols = kCols[std::min(n, MR) - 1];
  for (int64_t j = j0; j < j1; j += cols) {
    const int64_t C = std::min(cols, j1 - j);
    const W* next = j + C < j1 ? w + (j + C) * K : then;
    for (int64_t p = 0; p < n; p += MR) {
      const int64_t R = std::min(MR, n - p);
      kTiles<W>[R - 1][C - 1](x + p, w + j * K, K, res, p == 0 ? next : nullptr);
      epi(p, R, j, C, res);
    }
  }
}

// ---- the experts ----------------------------------------------------------------------------

// The (token, slot) pairs grouped by expert: pairs start[e]..start[e + 1] are expert e's, in
// token order (slot order within a token).
struct Routing {
  std::vector<int64_t> start;   // (E + 1,)
  std::vector<int64_t> token;   // (P,)
  std::vector<float> weight;    // (P,) the pair's weight in x's dtype, as float
  std::vector<int64_t> active;  // experts with pairs, ascending
};

template <typename Id, typename T>
Routing route_pairs(const Id* ids, const float* w, int64_t num_tokens, int64_t k, int64_t E) {
  Routing r;
  r.start.assign(E + 1, 0);
  for (int64_t i = 0; i < num_tokens * k; ++i)
    if (ids[i] >= 0 && ids[i] < E) ++r.start[ids[i] + 1];
  for (int64_t e = 0; e < E; ++e) {
    if (r.start[e + 1] > 0) r.active.push_back(e);
    r.start[e + 1] += r.start[e];
  }
  r.token.resize(r.start[E]);
  r.weight.resize(r.start[E]);
  std::vector<int64_t> fill(r.start.begin(), r.start.end() - 1);
  for (int64_t t = 0; t < num_tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      if (e < 0 || e >= E) continue;  // another replica's expert (expert parallelism): adds nothing
      const int64_t p = fill[e]++;
      r.token[p] = t;
      r.weight[p] = round_to<T>(w[t * k + j]);  // cast to x's dtype before the multiply
    }
  return r;
}

// a[p * sa + c] = to_T(to_T(silu(gate)) * up) for c < W, p < n, from gate = g[p * sg + c] and
// up = g[p * sg + W + c].
template <typename T>
void silu_mul(const float* g, int64_t sg, float* a, int64_t sa, int64_t n, int64_t W, int64_t vec_W) {
  // The first vec_W of the W columns take ATen's vector formula, the rest its scalar one: ATen
  // vectorizes a row but for its last I % VL elements, so which formula an element gets follows
  // its place in the whole row, never where a thread's share of the row ends (a share's last
  // partial vector is computed zero-padded: lanes do not interact).
  for (int64_t p = 0; p < n; ++p, g += sg, a += sa) {
    int64_t c = 0;
    for (; c < vec_W; c += VL) {
      const int64_t m = std::min<int64_t>(VL, vec_W - c);
      const vf x = m == VL ? load(g + c) : load_n(g + c, m);
      const vf u = m == VL ? load(g + W + c) : load_n(g + W + c, m);
      const vf s = round_to<T>(x / keep(1.0f + keep(sleef_expf(-x))));  // as ATen's vector silu
      const vf r = round_to<T>(s * u);
      if (m == VL) {
        store(a + c, r);
      } else {
        alignas(64) float tmp[VL];
        store(tmp, r);
        std::memcpy(a + c, tmp, m * sizeof(float));
      }
    }
    for (c = vec_W; c < W; ++c) {
      const float x = g[c];
      const float s = round_to<T>(x / keep(1.0f + keep(std::exp(-x))));  // (ATen's scalar tail)
      a[c] = round_to<T>(s * g[W + c]);
    }
  }
}

template <typename T>
void run_experts(const Routing& r, const float* const* xrows, const T* w13, const T* w2, int64_t H, int64_t I,
                 float* acc, T* out, int64_t num_tokens) {
  const int64_t P = r.start.back();
  std::vector<float> act(P * I);  // silu(gate) * up of every pair, in the slot<T>() layout
  std::vector<const float*> arows(P);
  for (int64_t p = 0; p < P; ++p) arows[p] = act.data() + p * I;

  std::vector<int64_t> following(r.start.size(), -1);  // the next active expert after each active one
  for (size_t a = 0; a + 1 < r.active.size(); ++a) following[r.active[a]] = r.active[a + 1];
  auto next_expert = [&](int64_t e) { return following[e]; };

  int64_t max_pairs = 0;
  for (const int64_t e : r.active) max_pairs = std::max(max_pairs, r.start[e + 1] - r.start[e]);

  auto gate_up = [&](int64_t c0, int64_t c1) {
    // the thread's gate and up outputs of one expert: row p = [gate (W) | up (W)], in the
    // slot<T>() layout (a thread's share is whole layout blocks: slot() keeps it in [c0, c1))
    const int64_t W = c1 - c0;
    std::vector<float> gu(max_pairs * 2 * W);
    auto keep_gu = [&](int64_t p, int64_t R, int64_t j, int64_t C, const float* res) {
      for (int64_t jj = 0; jj < C; ++jj) {
        const int64_t c = j + jj < I ? slot<T>(j + jj, I) - c0 : W + slot<T>(j + jj - I, I) - c0;
        for (int64_t i = 0; i < R; ++i) gu[(p + i) * 2 * W + c] = round_to<T>(res[i * C + jj]);
      }
    };
    for (const int64_t e : r.active) {
      const int64_t s = r.start[e], n = r.start[e + 1] - s;
      const T* we = w13 + e * 2 * I * H;
      const T* then = next_expert(e) >= 0 ? w13 + next_expert(e) * 2 * I * H + c0 * H : nullptr;
      gemm(xrows + s, n, we, H, c0, c1, we + (I + c0) * H, keep_gu);  // gate rows
      gemm(xrows + s, n, we, H, I + c0, I + c1, then, keep_gu);        // up rows
      silu_mul<T>(gu.data(), 2 * W, act.data() + s * I + c0, I, n, W, std::clamp<int64_t>(I - I % VL - c0, 0, W));
    }
  };
  auto down = [&](int64_t h0, int64_t h1) {
    for (int64_t t = 0; t < num_tokens; ++t) std::fill(acc + t * H + h0, acc + t * H + h1, 0.0f);
    for (const int64_t e : r.active) {  // ascending expert id: each token's sum in that order
      const int64_t s = r.start[e], n = r.start[e + 1] - s;
      auto add = [&](int64_t p, int64_t R, int64_t j, int64_t C, const float* res) {
        for (int64_t i = 0; i < R; ++i) {
          const float w = r.weight[s + p + i];
          float* o = acc + r.token[s + p + i] * H + j;
          for (int64_t jj = 0; jj < C; ++jj)
            o[jj] = round_to<T>(o[jj] + round_to<T>(round_to<T>(res[i * C + jj]) * w));
        }
      };
      gemm(arows.data() + s, n, w2 + e * H * I, I, h0, h1,
           next_expert(e) >= 0 ? w2 + (next_expert(e) * H + h0) * I : nullptr, add);
    }
    if constexpr (!std::is_same_v<T, float>)
      for (int64_t t = 0; t < num_tokens; ++t)
        for (int64_t h = h0; h < h1; ++h) out[t * H + h] = static_cast<bf16>(acc[t * H + h]);  // exact
  };

  const bool parallel = P * 3 * I * H >= kParallelFmas && at::get_num_threads() > 1;
  // Each thread's share of columns is one contiguous run (split evenly). The gate_up shares are
  // whole layout blocks: slot() then moves a column only within its thread's share.
  constexpr int64_t B = kBlock<T>;
  if (parallel)
    at::parallel_for(0, (I + B - 1) / B, std::max<int64_t>(1, 16 / B),
                     [&](int64_t b0, int64_t b1) { gate_up(b0 * B, std::min(I, b1 * B)); });
  else gate_up(0, I);
  if (parallel) at::parallel_for(0, H, 16, down);
  else down(0, H);
}

}  // namespace

at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_ids, const at::Tensor& topk_weights) {
  TORCH_CHECK(x.device().is_cpu() && w13.device().is_cpu() && w2.device().is_cpu() &&
                  topk_ids.device().is_cpu() && topk_weights.device().is_cpu(),
              "fused_experts: CPU tensors only");
  const at::ScalarType dt = x.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "fused_experts: float32 or bfloat16 only, got ", dt);
  TORCH_CHECK(w13.scalar_type() == dt && w2.scalar_type() == dt, "fused_experts: w13 and w2 must have x's dtype ",
              dt);
  TORCH_CHECK(x.dim() == 2 && (x.size(1) <= 1 || x.stride(1) == 1),
              "fused_experts: x must be (T, H) with a contiguous last dim");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w13.dim() == 3 && w13.is_contiguous() && w13.size(2) == H && w13.size(1) % 2 == 0,
              "fused_experts: w13 must be a contiguous (E, 2I, H=", H, ") tensor");
  const int64_t E = w13.size(0), I = w13.size(1) / 2;
  TORCH_CHECK(w2.dim() == 3 && w2.is_contiguous() && w2.size(0) == E && w2.size(1) == H && w2.size(2) == I,
              "fused_experts: w2 must be a contiguous (E=", E, ", H=", H, ", I=", I, ") tensor");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T &&
                  (topk_ids.scalar_type() == at::kInt || topk_ids.scalar_type() == at::kLong),
              "fused_experts: topk_ids must be (T=", T, ", k) int32 or int64");
  TORCH_CHECK(topk_weights.dim() == 2 && topk_weights.sizes() == topk_ids.sizes() &&
                  at::isFloatingType(topk_weights.scalar_type()),
              "fused_experts: topk_weights must be floating point, shaped like topk_ids");
  const int64_t k = topk_ids.size(1);
  at::Tensor out = at::Tensor(at::detail::empty_cpu({T, H}, dt));
  if (T == 0 || H == 0) return out;
  const at::Tensor ids = topk_ids.contiguous();
  const at::Tensor wts = topk_weights.to(at::kFloat).contiguous();

  auto run = [&](auto tag) {
    using T_ = decltype(tag);
    // x as float32 rows (bf16 widened once, in the slot() layout)
    std::vector<float> xf;
    const float* xbase;
    int64_t xstride = H;
    if constexpr (std::is_same_v<T_, float>) {
      xbase = x.data_ptr<float>();
      xstride = x.stride(0);
    } else {
      xf.resize(T * H);
      const bf16* xp = x.data_ptr<bf16>();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < H; ++h) xf[t * H + slot<T_>(h, H)] = static_cast<float>(xp[t * x.stride(0) + h]);
      xbase = xf.data();
    }
    // bf16 sums run in a float32 buffer (every value rounded to bf16 as it is stored)
    std::vector<float> acc_bf16;
    float* acc;
    if constexpr (std::is_same_v<T_, float>) {
      acc = out.data_ptr<float>();
    } else {
      acc_bf16.resize(T * H);
      acc = acc_bf16.data();
    }
    // Tokens in chunks of at most kMaxPairs pairs bound the scratch (act: pairs x I floats); a
    // token's result does not depend on its chunk, and past a few thousand pairs the arithmetic,
    // not the weight stream, sets the time.
    const int64_t chunk = std::max<int64_t>(1, kMaxPairs / std::max<int64_t>(1, k));
    for (int64_t t0 = 0; t0 < T; t0 += chunk) {
      const int64_t n = std::min(chunk, T - t0);
      const Routing r =
          ids.scalar_type() == at::kInt
              ? route_pairs<int32_t, T_>(ids.data_ptr<int32_t>() + t0 * k, wts.data_ptr<float>() + t0 * k, n, k, E)
              : route_pairs<int64_t, T_>(ids.data_ptr<int64_t>() + t0 * k, wts.data_ptr<float>() + t0 * k, n, k, E);
      std::vector<const float*> xrows(r.token.size());  // one per pair
      for (size_t p = 0; p < xrows.size(); ++p) xrows[p] = xbase + (t0 + r.token[p]) * xstride;
      run_experts<T_>(r, xrows.data(), w13.data_ptr<T_>(), w2.data_ptr<T_>(), H, I, acc + t0 * H,
                      out.data_ptr<T_>() + t0 * H, n);
    }
  };
  if (dt == at::kFloat) run(float{});
  else run(bf16{});
  return out;
}

}  // namespace rollout_moe
