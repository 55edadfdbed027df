// CPU paged-attention decode kernel: one query token per sequence.
//
// Layout contract (all tensors on CPU; checked in paged_decode_attention below):
//   q            (B, H, D)                          float32 or bfloat16, contiguous; D % 16 == 0
//   k_cache      (num_blocks, block_size, KVH, D)   same dtype as q, contiguous in its own shape;
//                or int8 (num_blocks, block_size, KVH, D + 4): rows of codes and a scale (vec.h)
//   v_cache      same shape/dtype as k_cache         (either may be a view such as kv[layer, 0])
//   block_table  (B, max_blocks) int32, last dim contiguous (rows may be strided). Entry j of
//                row b is the physical block holding tokens [j*block_size, (j+1)*block_size)
//                of sequence b; entries past the sequence's length are never read.
//   seq_lens     (B,) int32, >= 1: valid cached tokens per sequence, current token included.
//   sliding_window  <= 0: attend to every t < seq_len; W > 0: only t >= seq_len - W.
//   GQA: query head h reads kv head h / (H / KVH).
// Returns a new out (B, H, D) in q's dtype:
//   out[b, h] = softmax(scale * q[b, h] . K[b, kvh, t]) @ V[b, kvh, t] over the window.
//
// Algorithm: a sequence's window is cut into parts of kPartTokens tokens (one part for a
// window no longer than that); a work item is one part of one sequence for all its kv heads
// (each token's K and V rows are read whole, contiguous) or, with fewer sequences than 4 per
// thread, for one kv head. A window of several parts gets each part's max, sum and unnormalized
// output, and the thread that did its first part combines them, in part order, once every thread
// is done: a lone long sequence is spread over the threads (its 3 kv heads alone left one of two
// threads idle a third of the time). Each
// of at::get_num_threads() OpenMP threads takes one contiguous run of items holding about its
// share of the tokens, so it knows what it reads next: a prefetch cursor runs kPrefetchAhead
// tokens ahead of pass 1 through its items, into L2, one kv head's rows per (token, kv head)
// scored (the cache is cold in a decode step: the matmuls before flushed it, and blocks are
// scattered). The G = H / KVH query heads of a kv head are done together so each K/V row is
// loaded (and widened) once; where registers allow (AVX-512), their accumulators (and, over an
// int8 cache, their q rows) stay in registers for a chunk. Tokens are walked in chunks of <= L
// rows of one block (L = the vector's lanes). Pass 1 computes the scores q_g . k_i (L horizontal
// sums at a time) into a per-thread row; then a softmax with max subtraction; pass 2 accumulates
// p_gi * v_i. Each head's arithmetic is the same whatever the item shape, path or thread count
// (the parts are a function of the window alone), so results do not depend on the batch
// (batch-invariant mode relies on it). All math is float32 (bf16 is
// widened on load; int8 codes are widened, and a K row's scale multiplies its scores, a V row's
// its widened values), written with GCC/Clang vector extensions of the target's width (16
// floats with AVX-512, 8 with AVX2), so -march=native picks the instructions.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "ops.h"
#include "vec.h"

namespace {

using namespace rollout_vec;  // vectors of the target's own width: L = 16 floats with AVX-512, 8 with AVX2
using rollout_vec::load;      // overloaded below for bf16 and int8
using rollout_vec::store;

inline vfloat load(const c10::BFloat16* p) {  // bf16 -> f32: a zero half below each value
  const vhalf h = *reinterpret_cast<const vhalf_mem*>(p);
#if defined(__AVX512F__)  // one permute (GCC 12 makes 5 ops of the convertvector below)
  const vhalf z = {};
  return (vfloat)__builtin_shufflevector(z, h, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23, 8, 24, 9, 25,
                                         10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
  return (vfloat)(__builtin_convertvector(h, vuint) << 16);
#endif
}
// An int8 cache row's codes, widened, not yet scaled. The sign extension is an intrinsic: GCC 12
// makes L scalar loads of a convertvector from int8 (vpmovsxbd is one instruction).
inline vfloat load(const int8_t* p) {
#if defined(__AVX512F__)
  const vint x = (vint)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__)
  const vint x = (vint)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#else
  const vint x = __builtin_convertvector(*reinterpret_cast<const vbyte_mem*>(p), vint);
#endif
  return __builtin_convertvector(x, vfloat);
}
inline void store(c10::BFloat16* p, vfloat v) {  // f32 -> bf16 rounding like c10::BFloat16
  const vuint u = (vuint)v, rounded = (u + ((u >> 16) & 1) + 0x7FFF) >> 16;
  const vuint bits = v != v ? vuint{} + 0x7FC0 : rounded;  // NaN -> canonical quiet NaN
  *reinterpret_cast<vhalf_mem*>(p) = __builtin_convertvector(bits, vhalf);
}

#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
// Lane t of the result = sum of the lanes of v[t], t < L: L horizontal sums as one transposing
// tree (each level pairs up vectors and halves the lanes per token).
inline vfloat sum_lanes(const vfloat* v) {
#if defined(__AVX512F__)
  vfloat a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 8 lanes per token: lanes 0-7 <- v[2i], 8-15 <- v[2i+1]
    a[i] = SHUF(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           SHUF(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)  // 4 lanes per token
    b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           SHUF(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)  // 2 lanes per token
    c[i] = SHUF(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           SHUF(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return SHUF(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         SHUF(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  vfloat a[4], b[2];
  for (int i = 0; i < 4; ++i)  // 4 lanes per token: lanes 0-3 <- v[2i], 4-7 <- v[2i+1]
    a[i] = SHUF(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUF(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)  // 2 lanes per token
    b[i] = SHUF(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           SHUF(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return SHUF(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) + SHUF(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}
#undef SHUF

// exp(x) for the softmax (x <= 0 after max subtraction; -inf -> 0). Cody-Waite range
// reduction + degree-6 Taylor polynomial, relative error < 2e-7; x < -87 flushes to 0.
inline vfloat vexp(vfloat x) {
  const vint under = x < -87.0f;
  x = under ? splat(-87.0f) : x;
  const vfloat n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;  // round(x / ln2)
  const vfloat r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-6f;
  vfloat p = splat(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) p = p * r + c;
  const vint two_n = (__builtin_convertvector(n, vint) + 127) << 23;  // 2^n, n in [-126, 0]
  return (vfloat)((vint)(p * (vfloat)two_n) & ~under);
}

// How many tokens ahead of pass 1 the prefetch cursor runs (one chunk ahead, into L1, was ~1.5x
// slower from a cold cache; 16-64 tokens into L2 measured the same).
constexpr int64_t kPrefetchAhead = 32;

// The tokens of a window's part (a multiple of every vector width, so a part's score vectors
// start where the window's did). Windows up to this long are done as one part, as they were
// before parts existed; longer ones are cut so one sequence can use every thread.
constexpr int64_t kPartTokens = 512;

// One work item: tokens [lo, hi) of sequence b for kv heads kvh0 .. kvh0 + hpi - 1, part `part`
// of `parts`; `slot`: where a window of several parts keeps this part's partial results.
struct Item {
  int64_t b, kvh0, lo, hi, part, parts, slot;
};

// The target's vector registers. A kv head's G query heads keep their q rows (pass 1) or their
// accumulators (pass 2) in registers, beside one widened cache row, where (G + 1) * NV + 1 of
// them fit: AVX-512 at head_dim 64 up to G = 6, at 128 up to G = 2. Elsewhere (AVX2's 16 hold
// neither) the passes go through memory: q rows reloaded per token, V rows widened into a buffer.
#if defined(__AVX512F__)
constexpr int64_t kRegs = 32;
#else
constexpr int64_t kRegs = 16;
#endif
constexpr int64_t kMaxGroup = 6;

// Calls fn.template operator()<GC>() with GC = G as a compile-time constant (1 .. kMaxGroup).
template <typename Fn>
inline void with_group(int64_t G, Fn&& fn) {
  switch (G) {
    case 1: return fn(std::integral_constant<int64_t, 1>{});
    case 2: return fn(std::integral_constant<int64_t, 2>{});
    case 3: return fn(std::integral_constant<int64_t, 3>{});
    case 4: return fn(std::integral_constant<int64_t, 4>{});
    case 5: return fn(std::integral_constant<int64_t, 5>{});
    case 6: return fn(std::integral_constant<int64_t, 6>{});
    default: break;
  }
}

// Pass 1 over one chunk of one kv head: part[g * L + i] = q_g . k_i (lane sums pending) for cnt
// tokens whose rows start at `rows`, tok_stride apart; the G query rows (qv, NV vectors each) sit
// in registers for the chunk. Same FMA chain per output as the loop through memory.
template <typename C, int64_t NV, typename Prefetch>
inline void pass1_in_registers(const vfloat* qv, vfloat* part, const C* rows, int64_t tok_stride, int64_t cnt,
                               int64_t G, Prefetch&& advance_prefetch) {
  constexpr bool kCodes = std::is_same_v<C, int8_t>;
  with_group(G, [&](auto gc) {
    constexpr int64_t GC = decltype(gc)::value;
    vfloat qr[GC][NV];
    for (int64_t g = 0; g < GC; ++g)
      for (int64_t c = 0; c < NV; ++c) qr[g][c] = qv[g * NV + c];
    for (int64_t i = 0; i < cnt; ++i) {
      advance_prefetch(1);
      const C* row = rows + i * tok_stride;
      vfloat k[NV];
      for (int64_t c = 0; c < NV; ++c) k[c] = load(row + c * L);
      const float ks = kCodes ? row_scale(reinterpret_cast<const int8_t*>(row), NV * L) : 1.0f;
      for (int64_t g = 0; g < GC; ++g) {
        vfloat dot = qr[g][0] * k[0];
        for (int64_t c = 1; c < NV; ++c) dot += qr[g][c] * k[c];
        part[g * L + i] = kCodes ? dot * ks : dot;
      }
    }
  });
}

// Pass 2 over one chunk of one kv head: acc[g * NV + c] += sum_i p[g * s_stride + i] * v_i[c] for
// cnt tokens whose V rows start at `rows`, tok_stride apart: each row widened once, in registers,
// for the G heads, whose accumulators sit in registers for the chunk. Same FMA chain per output
// as the loop through vbuf.
template <typename C, int64_t NV>
inline void pass2_in_registers(vfloat* acc, const float* p, int64_t s_stride, const C* rows, int64_t tok_stride,
                               int64_t cnt, int64_t G) {
  constexpr bool kCodes = std::is_same_v<C, int8_t>;
  with_group(G, [&](auto gc) {
    constexpr int64_t GC = decltype(gc)::value;
    vfloat a[GC][NV];
    for (int64_t g = 0; g < GC; ++g)
      for (int64_t c = 0; c < NV; ++c) a[g][c] = acc[g * NV + c];
    for (int64_t i = 0; i < cnt; ++i) {
      const C* row = rows + i * tok_stride;
      const float vs = kCodes ? row_scale(reinterpret_cast<const int8_t*>(row), NV * L) : 1.0f;
      vfloat v[NV];
      for (int64_t c = 0; c < NV; ++c) v[c] = kCodes ? load(row + c * L) * vs : load(row + c * L);
      for (int64_t g = 0; g < GC; ++g) {
        const float pi = p[g * s_stride + i];
        for (int64_t c = 0; c < NV; ++c) a[g][c] += pi * v[c];
      }
    }
    for (int64_t g = 0; g < GC; ++g)
      for (int64_t c = 0; c < NV; ++c) acc[g * NV + c] = a[g][c];
  });
}

// NV = D / L vectors per head row; a compile-time NV (> 0) lets the row loops unroll into
// registers, NV = 0 reads it from D at run time.
// T: q's and out's dtype; C: the cache's (T, or int8_t for rows of codes and a scale).
template <typename T, typename C, int64_t NV_FIXED>
void decode_kernel(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                   int64_t bt_stride, const int32_t* seq_lens, T* out, int64_t B, int64_t H,
                   int64_t KVH, int64_t D, int64_t bs, float scale, int64_t window,
                   int64_t max_len, int n_threads) {
  constexpr int64_t kMaxNV = NV_FIXED > 0 ? NV_FIXED : 512 / L;  // D <= 512 (checked)
  constexpr bool kIsFloat = std::is_same_v<C, float>, kCodes = std::is_same_v<C, int8_t>;
  const int64_t NV = NV_FIXED > 0 ? NV_FIXED : D / L;
  const int64_t G = H / KVH;
  const int64_t RD = kCodes ? D + kScaleBytes : D;  // a cache row's elements
  const int64_t tok_stride = KVH * RD;         // between consecutive tokens of a block
  const int64_t blk_stride = bs * tok_stride;  // between physical blocks
  // An item is `hpi` kv heads of one sequence: all of them when there are enough sequences to
  // keep the threads busy (whole K/V rows stream faster than every third 128 bytes).
  const int64_t hpi = B >= 4 * n_threads ? KVH : 1;
  const int64_t GH = hpi * G;  // query heads per item
  const int64_t s_stride = (std::min(max_len, kPartTokens) / L + 2) * L;  // a score row, + a full-vector store
  // the register passes take NV at compile time (kRegNV, only used when NV_FIXED > 0)
  constexpr int64_t kRegNV = NV_FIXED > 0 ? NV_FIXED : 1;
  const bool in_registers = NV_FIXED > 0 && G <= kMaxGroup && (G + 1) * NV + 1 <= kRegs;

  std::vector<Item> items;
  int64_t n_slots = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = seq_lens[b], start = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t parts = (len - start + kPartTokens - 1) / kPartTokens;
    for (int64_t kvh0 = 0; kvh0 < KVH; kvh0 += hpi)
      for (int64_t p = 0; p < parts; ++p)
        items.push_back({b, kvh0, start + p * kPartTokens, std::min(len, start + (p + 1) * kPartTokens), p, parts,
                         parts > 1 ? n_slots++ : -1});
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::vector<int64_t> cum(n_items + 1, 0);  // tokens in items before item i
  for (int64_t it = 0; it < n_items; ++it) cum[it + 1] = cum[it] + items[it].hi - items[it].lo;
  // A part's partial results, per query head of its item: max score, sum of exp, then NV vectors
  // of the unnormalized output (written by the part's thread, read by its first part's after the
  // barrier)
  const int64_t slot_floats = 2 + NV * L;
  std::vector<float> partials(n_slots * GH * slot_floats);

#pragma omp parallel num_threads(n_threads)
  {
    std::vector<vfloat> qv(GH * NV), acc(GH * NV), part(GH * L), vbuf(kIsFloat ? 0 : L * hpi * NV);
    std::vector<float> scores(GH * s_stride), maxes(GH), sums(GH);  // scores: GH rows of s_stride
    // This thread's items: [first, last), about 1 / team of the tokens.
    const int64_t team = omp_get_num_threads(), tid = omp_get_thread_num();
    auto split = [&](int64_t i) {
      return std::lower_bound(cum.begin(), cum.end(), cum[n_items] * i / team) - cum.begin();
    };
    const int64_t first = split(tid), last = tid + 1 == team ? n_items : split(tid + 1);
    // The prefetch cursor: kv head pf_h (of the item's hpi) of token pf_t of pf_item, at offset
    // pf_off of its block pf_blocks[pf_j]; a step prefetches that head's K and V rows. Kept
    // incrementally: a division per token (block and offset) costs as much as scoring it.
    int64_t pf_item = first, pf_t = 0, pf_len = 0, pf_j = 0, pf_off = 0, pf_head = 0, pf_h = 0;
    const int32_t* pf_blocks = block_table;
    auto start_prefetch_item = [&] {
      const Item& it = items[pf_item];
      pf_t = it.lo, pf_len = it.hi;
      pf_j = pf_t / bs, pf_off = pf_t - pf_j * bs;
      pf_blocks = block_table + it.b * bt_stride;
      pf_head = it.kvh0 * RD;
    };
    if (pf_item < last) start_prefetch_item();
    auto advance_prefetch = [&](int64_t budget) {  // K and V rows of the next `budget` (token, kv head)s
      while (budget > 0 && pf_item < last) {
        if (pf_t >= pf_len) {
          if (++pf_item >= last) break;
          start_prefetch_item();
          continue;
        }
        const int64_t off = pf_blocks[pf_j] * blk_stride + pf_off * tok_stride + pf_head + pf_h * RD;
        for (int64_t c = 0; c < RD; c += 64 / int64_t(sizeof(C)))
          __builtin_prefetch(k_cache + off + c, 0, 1), __builtin_prefetch(v_cache + off + c, 0, 1);  // into L2
        --budget;
        if (++pf_h < hpi) continue;
        pf_h = 0, ++pf_t;
        if (++pf_off == bs) pf_off = 0, ++pf_j;
      }
    };
    advance_prefetch(kPrefetchAhead * hpi);
    for (int64_t item = first; item < last; ++item) {
      const Item& it = items[item];
      const int64_t b = it.b, kvh0 = it.kvh0, start = it.lo, len = it.hi;
      const int64_t n = len - start, n_pad = (n + L - 1) / L * L;
      const int32_t* blocks = block_table + b * bt_stride;

      // Calls fn(i0, cnt, offset) for each chunk: tokens i0 .. i0+cnt-1 of the part (cnt <= L,
      // all in one block), whose rows (of kv head kvh0) start at cache + offset, tok_stride apart.
      auto for_each_chunk = [&](auto&& fn) {
        int64_t j = start / bs, off = start - j * bs;
        for (int64_t t = start; t < len;) {
          const int64_t cnt = std::min({L, len - t, bs - off});
          fn(t - start, cnt, blocks[j] * blk_stride + off * tok_stride + kvh0 * RD);
          t += cnt, off += cnt;
          if (off == bs) off = 0, ++j;
        }
      };

      // Query heads kvh0*G .. kvh0*G+GH-1 (contiguous in q), pre-scaled.
      const T* q_grp = q + (b * H + kvh0 * G) * D;
      for (int64_t c = 0; c < GH * NV; ++c) qv[c] = load(q_grp + c * L) * scale;

      // Pass 1: scores[r * s_stride + i] = q_r . k_i (r = hh * G + g), L tokens per vector store.
      for_each_chunk([&](int64_t i0, int64_t cnt, int64_t offset) {
        // q in registers means one walk of the chunk per kv head: for int8 rows that beat the walk
        // below 1.1-1.25x from a cold cache, for float and bf16 rows (twice or four times the
        // bytes) it lost by as much, so they keep reading each token's rows whole.
        if (in_registers && kCodes) {
          for (int64_t hh = 0; hh < hpi; ++hh)  // each walk prefetches one kv head's rows per token
            pass1_in_registers<C, kRegNV>(qv.data() + hh * G * NV, part.data() + hh * G * L, k_cache + offset + hh * RD,
                                          tok_stride, cnt, G, advance_prefetch);
        } else {
          for (int64_t i = 0; i < cnt; ++i) {
            // One token's rows per token done: a burst of a whole chunk's prefetches (192 lines)
            // overflowed the miss buffers and stalled the loop (~20% slower).
            advance_prefetch(hpi);
            for (int64_t hh = 0; hh < hpi; ++hh) {
              const C* row = k_cache + offset + i * tok_stride + hh * RD;
              vfloat k[kMaxNV];
              for (int64_t c = 0; c < NV; ++c) k[c] = load(row + c * L);
              const float ks = kCodes ? row_scale(reinterpret_cast<const int8_t*>(row), D) : 1.0f;
              for (int64_t g = 0; g < G; ++g) {
                const vfloat* qr = &qv[(hh * G + g) * NV];
                vfloat dot = qr[0] * k[0];
                for (int64_t c = 1; c < NV; ++c) dot += qr[c] * k[c];
                part[(hh * G + g) * L + i] = kCodes ? dot * ks : dot;
              }
            }
          }
        }
        // Lanes >= cnt hold stale sums; the next chunk (or the -inf padding) overwrites them.
        for (int64_t r = 0; r < GH; ++r) store(&scores[r * s_stride + i0], sum_lanes(&part[r * L]));
      });

      // Softmax numerators in place (padding lanes are -inf -> 0); keep 1 / denominator.
      for (int64_t r = 0; r < GH; ++r) {
        float* s = scores.data() + r * s_stride;
        std::fill(s + n, s + n_pad, -std::numeric_limits<float>::infinity());
        vfloat mv = load(s);
        for (int64_t i = L; i < n_pad; i += L) mv = maximum(mv, load(s + i));
        const float mx = maxes[r] = reduce(mv, maximum);
        vfloat sum = {};
        for (int64_t i = 0; i < n_pad; i += L) {
          const vfloat e = vexp(load(s + i) - mx);
          store(s + i, e);
          sum += e;
        }
        sums[r] = reduce(sum, plus);
      }

      // Pass 2: acc_r = sum_i p_ri * v_i: in registers where they fit (each V row widened once for
      // its G heads), else each row widened once into vbuf and read from there per head.
      std::fill(acc.begin(), acc.end(), vfloat{});
      if (in_registers) {
        for_each_chunk([&](int64_t i0, int64_t cnt, int64_t offset) {
          for (int64_t hh = 0; hh < hpi; ++hh)
            pass2_in_registers<C, kRegNV>(acc.data() + hh * G * NV, scores.data() + hh * G * s_stride + i0, s_stride,
                                          v_cache + offset + hh * RD, tok_stride, cnt, G);
        });
      } else {
        for_each_chunk([&](int64_t i0, int64_t cnt, int64_t offset) {
          const float* rows;
          int64_t row_stride;
          if constexpr (kIsFloat) {
            rows = v_cache + offset, row_stride = tok_stride;
          } else {
            for (int64_t i = 0; i < cnt; ++i)
              for (int64_t hh = 0; hh < hpi; ++hh) {
                const C* row = v_cache + offset + i * tok_stride + hh * RD;
                const float vs = kCodes ? row_scale(reinterpret_cast<const int8_t*>(row), D) : 1.0f;
                for (int64_t c = 0; c < NV; ++c)
                  vbuf[(i * hpi + hh) * NV + c] = kCodes ? load(row + c * L) * vs : load(row + c * L);
              }
            rows = reinterpret_cast<const float*>(vbuf.data()), row_stride = hpi * D;
          }
          for (int64_t hh = 0, r = 0; hh < hpi; ++hh)  // query head r = hh * G + g reads kv head hh's rows
            for (int64_t g = 0; g < G; ++g, ++r) {
              const float* p = &scores[r * s_stride + i0];
              const float* vr = rows + hh * D;
              vfloat a[kMaxNV];
              for (int64_t c = 0; c < NV; ++c) a[c] = acc[r * NV + c];
              for (int64_t i = 0; i < cnt; ++i)
                for (int64_t c = 0; c < NV; ++c) a[c] += p[i] * load(vr + i * row_stride + c * L);
              for (int64_t c = 0; c < NV; ++c) acc[r * NV + c] = a[c];
            }
        });
      }

      if (it.parts == 1) {
        T* o = out + (b * H + kvh0 * G) * D;
        for (int64_t r = 0; r < GH; ++r) {
          const float inv_sum = 1.0f / sums[r];
          for (int64_t c = 0; c < NV; ++c) store(o + r * D + c * L, acc[r * NV + c] * inv_sum);
        }
        continue;
      }
      float* slot = partials.data() + it.slot * GH * slot_floats;
      for (int64_t r = 0; r < GH; ++r, slot += slot_floats) {
        slot[0] = maxes[r], slot[1] = sums[r];
        for (int64_t c = 0; c < NV; ++c) store(slot + 2 + c * L, acc[r * NV + c]);
      }
    }
    if (n_slots > 0) {  // (the same for every thread: all of them or none meet the barrier)
#pragma omp barrier
      // The windows of several parts whose first part this thread did: out = sum_p w_p acc_p /
      // sum_p w_p sum_p with w_p = exp(max_p - max), parts in order.
      for (int64_t item = first; item < last; ++item) {
        const Item& it = items[item];
        if (it.parts == 1 || it.part != 0) continue;
        T* o = out + (it.b * H + it.kvh0 * G) * D;
        for (int64_t r = 0; r < GH; ++r) {
          const float* p0 = partials.data() + (it.slot * GH + r) * slot_floats;
          const int64_t part_stride = GH * slot_floats;  // the same head in the next part
          float mx = p0[0];
          for (int64_t p = 1; p < it.parts; ++p) mx = std::max(mx, p0[p * part_stride]);
          float total = 0.0f;
          vfloat a[kMaxNV] = {};
          for (int64_t p = 0; p < it.parts; ++p) {
            const float* part_r = p0 + p * part_stride;
            const float w = std::exp(part_r[0] - mx);
            total += w * part_r[1];
            for (int64_t c = 0; c < NV; ++c) a[c] += w * load(part_r + 2 + c * L);
          }
          const float inv_total = 1.0f / total;
          for (int64_t c = 0; c < NV; ++c) store(o + r * D + c * L, a[c] * inv_total);
        }
      }
    }
  }
}

// ---- prefill: many query tokens per sequence -------------------------------------------------
// Work item = (sequence, kv head, tile of <= kTileRows query tokens); its R = rows * G query
// vectors (all G heads of the kv head) share every K/V row load. Keys are walked in chunks of
// kKeyChunk with an online softmax: each chunk's K is widened and transposed (d-major, so a
// score vector of L keys is D FMAs with broadcast q elements, no horizontal sums) and its V
// widened, both into per-thread buffers that stay in L1/L2.
constexpr int64_t kTileRows = 16, kKeyChunk = 64;

template <typename T, typename C, int64_t NV_FIXED>
void prefill_kernel(const T* q, const C* k_cache, const C* v_cache, const int32_t* block_table,
                    int64_t bt_stride, const int32_t* cu_q, const int32_t* seq_lens, T* out,
                    const std::vector<std::pair<int32_t, int32_t>>& tiles, int64_t H, int64_t KVH,
                    int64_t D, int64_t bs, float scale, int64_t window, int n_threads) {
  constexpr int64_t kMaxNV = NV_FIXED > 0 ? NV_FIXED : 512 / L;
  const int64_t NV = NV_FIXED > 0 ? NV_FIXED : D / L;
  const int64_t G = H / KVH, max_r = kTileRows * G;
  constexpr bool kCodes = std::is_same_v<C, int8_t>;
  const int64_t RD = kCodes ? D + kScaleBytes : D;  // a cache row's elements
  const int64_t tok_stride = KVH * RD, blk_stride = bs * tok_stride;
  const int64_t n_items = static_cast<int64_t>(tiles.size()) * KVH;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(n_threads)
  {
    std::vector<float> qf(max_r * D), kt(D * kKeyChunk), vf(kKeyChunk * D), s(max_r * kKeyChunk);
    std::vector<float> m(max_r), l(max_r);
    std::vector<vfloat> acc(max_r * NV);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = n_items - 1; item >= 0; --item) {  // the costly last tiles first
      const auto [b, i0] = tiles[item / KVH];
      const int64_t kvh = item % KVH;
      const int64_t q_len = cu_q[b + 1] - cu_q[b], len = seq_lens[b], ctx = len - q_len;
      const int64_t rows = std::min(kTileRows, q_len - i0), R = rows * G;
      const int64_t p0 = ctx + i0, p1 = ctx + i0 + rows - 1;  // positions of the first/last query
      const int64_t lo = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0, hi = p1 + 1;
      const int32_t* blocks = block_table + b * bt_stride;
      // query vector r * G + g = head kvh * G + g of query token i0 + r, pre-scaled
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const T* src = q + ((cu_q[b] + i0 + r) * H + kvh * G + g) * D;
          for (int64_t c = 0; c < NV; ++c) store(&qf[(r * G + g) * D + c * L], load(src + c * L) * scale);
        }
      std::fill(m.begin(), m.begin() + R, kNegInf);
      std::fill(l.begin(), l.begin() + R, 0.0f);
      std::fill(acc.begin(), acc.begin() + R * NV, vfloat{});

      for (int64_t k0 = lo; k0 < hi; k0 += kKeyChunk) {
        const int64_t nk = std::min(kKeyChunk, hi - k0), nvec = (nk + L - 1) / L;
        for (int64_t t = 0; t < nk; ++t) {  // widen K (transposed) and V of keys k0 .. k0+nk-1
          const int64_t pos = k0 + t, off = blocks[pos / bs] * blk_stride + pos % bs * tok_stride + kvh * RD;
          const C *krow = k_cache + off, *vrow = v_cache + off;
          float ks = 1.0f, vs = 1.0f;
          if constexpr (kCodes) ks = row_scale(krow, D), vs = row_scale(vrow, D);
          for (int64_t c = 0; c < NV; ++c) {
            const vfloat kv = kCodes ? load(krow + c * L) * ks : load(krow + c * L);
            for (int64_t j = 0; j < L; ++j) kt[(c * L + j) * kKeyChunk + t] = kv[j];
            store(&vf[t * D + c * L], kCodes ? load(vrow + c * L) * vs : load(vrow + c * L));
          }
        }
        for (int64_t t = nk; t < nvec * L; ++t)
          for (int64_t d = 0; d < D; ++d) kt[d * kKeyChunk + t] = 0.0f;
        // scores, 4 query vectors x L keys at a time
        for (int64_t r = 0; r < R; r += 4) {
          const int64_t nr = std::min<int64_t>(4, R - r);
          for (int64_t c = 0; c < nvec; ++c) {
            vfloat a0 = {}, a1 = {}, a2 = {}, a3 = {};
            const float* q0 = &qf[r * D];
            for (int64_t d = 0; d < D; ++d) {
              const vfloat kd = load(&kt[d * kKeyChunk + c * L]);
              a0 += q0[d] * kd;
              if (nr > 1) a1 += q0[D + d] * kd;
              if (nr > 2) a2 += q0[2 * D + d] * kd;
              if (nr > 3) a3 += q0[3 * D + d] * kd;
            }
            const vfloat res[4] = {a0, a1, a2, a3};
            for (int64_t j = 0; j < nr; ++j) store(&s[(r + j) * kKeyChunk + c * L], res[j]);
          }
        }
        // mask, online softmax, and acc += p @ V, one query vector at a time
        vfloat key_pos;
        for (int64_t j = 0; j < L; ++j) key_pos[j] = static_cast<float>(j);
        for (int64_t r = 0; r < R; ++r) {
          const int64_t p = p0 + r / G;  // this query's position: keys k0+t with t <= p-k0 (and in the window)
          const int64_t t_hi = std::min(nk, p - k0 + 1), t_lo = window > 0 ? std::max<int64_t>(0, p - window + 1 - k0) : 0;
          if (t_hi <= t_lo) continue;
          float* sr = &s[r * kKeyChunk];
          vfloat mx = splat(kNegInf);
          for (int64_t c = 0; c < nvec; ++c) {
            const vfloat t = key_pos + static_cast<float>(c * L);
            const vfloat x = load(sr + c * L);
            const vfloat masked = (t >= static_cast<float>(t_lo)) & (t < static_cast<float>(t_hi)) ? x : splat(kNegInf);
            store(sr + c * L, masked);
            mx = maximum(mx, masked);
          }
          const float m_new = std::max(m[r], reduce(mx, maximum));
          const float alpha = m[r] == kNegInf ? 0.0f : std::exp(m[r] - m_new);
          vfloat sum = {};
          for (int64_t c = 0; c < nvec; ++c) {
            const vfloat e = vexp(load(sr + c * L) - m_new);
            store(sr + c * L, e);
            sum += e;
          }
          l[r] = l[r] * alpha + reduce(sum, plus);
          m[r] = m_new;
          vfloat a[kMaxNV];
          for (int64_t c = 0; c < NV; ++c) a[c] = acc[r * NV + c] * alpha;
          for (int64_t t = t_lo; t < t_hi; ++t)
            for (int64_t c = 0; c < NV; ++c) a[c] += sr[t] * load(&vf[t * D + c * L]);
          for (int64_t c = 0; c < NV; ++c) acc[r * NV + c] = a[c];
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        T* o = out + ((cu_q[b] + i0 + r / G) * H + kvh * G + r % G) * D;
        const float inv = 1.0f / l[r];
        for (int64_t c = 0; c < NV; ++c) store(o + c * L, acc[r * NV + c] * inv);
      }
    }
  }
}

template <typename T, typename C>
void dispatch_head_dim(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const int32_t* bt, int64_t bt_stride, const int32_t* lens, at::Tensor& out,
                       int64_t KVH, int64_t bs, float scale, int64_t window, int64_t max_len,
                       int n_threads) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<T>(), static_cast<const C*>(k.data_ptr()), static_cast<const C*>(v.data_ptr()), bt,
           bt_stride, lens, out.data_ptr<T>(), B, H, KVH, D, bs, scale, window, max_len, n_threads);
  };
  if (D == 64) run(decode_kernel<T, C, 64 / L>);
  else if (D == 128) run(decode_kernel<T, C, 128 / L>);
  else run(decode_kernel<T, C, 0>);
}

// The layout both attention ops need of q (rows, H, D) and the cache (see the top of this file).
void check_q_and_cache(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const char* q_shape) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous ", q_shape, " tensor");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(),
              "k_cache/v_cache must be contiguous (num_blocks, block_size, KVH, D) tensors");
  const bool codes = k_cache.scalar_type() == at::kChar;
  TORCH_CHECK((k_cache.scalar_type() == q.scalar_type() || codes) &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "k_cache and v_cache must share q's dtype, or both be int8 rows of codes and a scale");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D + (codes ? kScaleBytes : 0),
              codes ? "an int8 cache row must hold head_dim codes and a 4-byte scale"
                    : "head_dim of q and the cache differ");
  TORCH_CHECK(D % 16 == 0 && D <= 512, "head_dim must be a multiple of 16, at most 512");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window) {
  for (const auto* t : {&q, &k_cache, &v_cache, &block_table, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode_attention: all tensors must be on CPU");
  check_q_and_cache(q, k_cache, v_cache, "(B, H, D)");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == B && block_table.stride(1) == 1,
              "block_table must be int32 (B, max_blocks) with a contiguous last dim");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 &&
                  seq_lens.size(0) == B && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 (B,) tensor");

  // Validate lengths and the block-table entries that will be read (cheap: B * len / bs).
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0), max_blocks = block_table.size(1);
  int64_t max_len = 1, total_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len >= 1 && len <= max_blocks * bs, "seq_lens[", b, "] = ", len, " out of range");
    const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
    for (int64_t j = start / bs; j * bs < len; ++j)
      TORCH_CHECK(bt[b * bt_stride + j] >= 0 && bt[b * bt_stride + j] < num_blocks,
                  "block_table[", b, ", ", j, "] = ", bt[b * bt_stride + j], " out of range");
    max_len = std::max(max_len, len - start);
    total_len += len - start;
  }
  // Tiny calls (~10 us of work) run on one thread: waking a second one costs about as much,
  // and a sibling thread that the OS has descheduled stalls the call for a whole time slice.
  const int64_t most_items = B * KVH * ((max_len + kPartTokens - 1) / kPartTokens);
  const int n_threads = total_len * KVH < 2048 ? 1 : std::min<int64_t>(at::get_num_threads(), most_items);

  at::Tensor out = at::empty_like(q);
  if (B == 0 || H == 0) return out;
  const float s = static_cast<float>(scale);
  const bool codes = k_cache.scalar_type() == at::kChar;
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    if (codes)
      dispatch_head_dim<T, int8_t>(q, k_cache, v_cache, bt, bt_stride, lens, out, KVH, bs, s, sliding_window,
                                   max_len, n_threads);
    else
      dispatch_head_dim<T, T>(q, k_cache, v_cache, bt, bt_stride, lens, out, KVH, bs, s, sliding_window, max_len,
                              n_threads);
  };
  if (q.scalar_type() == at::kFloat) run((float*)nullptr);
  else if (q.scalar_type() == at::kBFloat16) run((c10::BFloat16*)nullptr);
  else TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ", q.scalar_type());
  return out;
}

at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   const at::Tensor& cu_q_lens, const at::Tensor& seq_lens,
                                   double scale, int64_t sliding_window) {
  for (const auto* t : {&q, &k_cache, &v_cache, &block_table, &cu_q_lens, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_prefill_attention: all tensors must be on CPU");
  check_q_and_cache(q, k_cache, v_cache, "(T, H, D)");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = seq_lens.size(0);
  const int64_t num_blocks = k_cache.size(0), bs = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.size(0) == B && block_table.stride(1) == 1,
              "block_table must be int32 (B, max_blocks) with a contiguous last dim");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.dim() == 1 && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous int32 (B,) tensor");
  TORCH_CHECK(cu_q_lens.scalar_type() == at::kInt && cu_q_lens.dim() == 1 &&
                  cu_q_lens.size(0) == B + 1 && cu_q_lens.is_contiguous(),
              "cu_q_lens must be a contiguous int32 (B + 1,) tensor");

  // Validate the ragged layout and the block-table entries that will be read; list the tiles.
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* cu = cu_q_lens.data_ptr<int32_t>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  const int64_t bt_stride = block_table.stride(0), max_blocks = block_table.size(1);
  TORCH_CHECK(cu[0] == 0 && cu[B] == T, "cu_q_lens must run from 0 to the number of query rows");
  std::vector<std::pair<int32_t, int32_t>> tiles;
  int64_t work = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q_len = cu[b + 1] - cu[b], len = lens[b];
    TORCH_CHECK(q_len >= 1 && len >= q_len && len <= max_blocks * bs, "sequence ", b, ": ", q_len,
                " queries over ", len, " cached tokens is out of range");
    const int64_t first = len - q_len, start = sliding_window > 0 ? std::max<int64_t>(0, first - sliding_window + 1) : 0;
    for (int64_t j = start / bs; j * bs < len; ++j)
      TORCH_CHECK(bt[b * bt_stride + j] >= 0 && bt[b * bt_stride + j] < num_blocks,
                  "block_table[", b, ", ", j, "] = ", bt[b * bt_stride + j], " out of range");
    for (int64_t i0 = 0; i0 < q_len; i0 += kTileRows) tiles.emplace_back(b, i0);
    work += q_len * (len - start);
  }
  const int n_threads = work * H < 4096 ? 1 : std::min<int64_t>(at::get_num_threads(), tiles.size() * KVH);

  at::Tensor out = at::empty_like(q);
  if (T == 0 || H == 0) return out;
  const float s = static_cast<float>(scale);
  auto launch = [&](auto* tag, auto* cache_tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    using C_ = std::remove_pointer_t<decltype(cache_tag)>;
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<T_>(), static_cast<const C_*>(k_cache.data_ptr()), static_cast<const C_*>(v_cache.data_ptr()),
             bt, bt_stride, cu, lens, out.data_ptr<T_>(), tiles, H, KVH, D, bs, s, sliding_window, n_threads);
    };
    if (D == 64) run(prefill_kernel<T_, C_, 64 / L>);
    else if (D == 128) run(prefill_kernel<T_, C_, 128 / L>);
    else run(prefill_kernel<T_, C_, 0>);
  };
  auto by_cache = [&](auto* tag) {
    using T_ = std::remove_pointer_t<decltype(tag)>;
    if (k_cache.scalar_type() == at::kChar) launch(tag, (int8_t*)nullptr);
    else launch(tag, (T_*)nullptr);
  };
  if (q.scalar_type() == at::kFloat) by_cache((float*)nullptr);
  else if (q.scalar_type() == at::kBFloat16) by_cache((c10::BFloat16*)nullptr);
  else TORCH_CHECK(false, "paged_prefill_attention: float32 or bfloat16 only, got ", q.scalar_type());
  return out;
}
