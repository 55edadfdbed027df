// Float32 vectors (GCC/Clang vector extensions) shared by the CPU kernels; -march=native picks
// the SIMD instructions. The kernels work in vectors of the target's own width, L floats in one
// register (16 with AVX-512, 8 with AVX2): GCC emulates wider ones with pairs of registers, and
// builds every broadcast scalar through memory, 2-4x slower. Each kernel file adds its own bf16
// load/store, tuned and rounded for what it must match.
#pragma once

#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rollout_vec {

// Vectors of N lanes: float, int32, uint32, bf16 bits (uint16) and int8, and unaligned, aliasing
// views for loads and stores anywhere in float / bf16 / int8 arrays. (Not memcpy: with
// -march=native GCC splits a 64-byte memcpy in two and then stalls on store forwarding.)
template <int64_t N>
struct Lanes {
  typedef float f __attribute__((vector_size(4 * N)));
  typedef int32_t i __attribute__((vector_size(4 * N)));
  typedef uint32_t u __attribute__((vector_size(4 * N)));
  typedef uint16_t h __attribute__((vector_size(2 * N)));
  typedef int8_t b __attribute__((vector_size(N)));
  typedef float f_mem __attribute__((vector_size(4 * N), aligned(4), may_alias));
  typedef uint16_t h_mem __attribute__((vector_size(2 * N), aligned(2), may_alias));
  typedef int8_t b_mem __attribute__((vector_size(N), aligned(1), may_alias));
};

#if defined(__AVX512F__)
constexpr int64_t L = 16;  // lanes of the target's vectors
#else
constexpr int64_t L = 8;
#endif
typedef Lanes<L>::f vfloat;
typedef Lanes<L>::i vint;
typedef Lanes<L>::u vuint;
typedef Lanes<L>::h vhalf;
typedef Lanes<L>::b vbyte;
typedef Lanes<L>::f_mem vfloat_mem;
typedef Lanes<L>::h_mem vhalf_mem;
typedef Lanes<L>::b_mem vbyte_mem;
typedef Lanes<8>::f vfloat8;
typedef Lanes<16>::f vfloat16;

inline vfloat splat(float x) { return vfloat{} + x; }
inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_mem*>(p); }
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_mem*>(p) = v; }
inline vint lane_ids() {  // {0, 1, ..., L - 1}
  vint v = {};
  for (int32_t i = 0; i < L; ++i) v[i] = i;
  return v;
}

// Materializes a float32 value: GCC contracts a*b+c into an FMA by default (also across
// statements), which would skip a rounding that torch, computing a*b in a separate kernel, does.
#if defined(__x86_64__) && defined(__AVX__)
inline vfloat8 keep(vfloat8 x) { asm("" : "+x"(x)); return x; }
inline float keep(float x) { asm("" : "+x"(x)); return x; }
#else
inline vfloat8 keep(vfloat8 x) { asm("" : "+m"(x)); return x; }
inline float keep(float x) { asm("" : "+m"(x)); return x; }
#endif
#if defined(__x86_64__) && defined(__AVX512F__)
inline vfloat16 keep(vfloat16 x) { asm("" : "+v"(x)); return x; }
#elif defined(__x86_64__) && defined(__AVX__)  // two 8-lane registers (not a trip through memory)
inline vfloat16 keep(vfloat16 x) {
  vfloat8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  vfloat8 b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  asm("" : "+x"(a), "+x"(b));
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
inline vfloat16 keep(vfloat16 x) { asm("" : "+m"(x)); return x; }
#endif

// Horizontal reduction by a fixed halving tree (lanes i and i + 8, then i and i + 4, ...): the
// same order wherever it is called (batch-invariant mode relies on it). A 16-lane sum is the
// 8-lane tree over (lanes 0-7) op (lanes 8-15), on every target.
template <typename Op>
inline float reduce(vfloat8 v, Op op) {
  auto b = op(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7));
  auto c = op(__builtin_shufflevector(b, b, 0, 1), __builtin_shufflevector(b, b, 2, 3));
  return op(c[0], c[1]);
}
template <typename Op>
inline float reduce(vfloat16 v, Op op) {
  return reduce(op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)), op);
}
const auto plus = [](auto a, auto b) { return a + b; };
const auto maximum = [](auto a, auto b) { return a > b ? a : b; };

// Sums that give the same bits on every target are taken in 16-lane order: element c of a row
// goes to lane c % 16. With L = 8 that is two accumulators, even and odd vectors (kWide of them,
// indexed by (c / L) % kWide), joined as the 16-lane tree's first level does.
constexpr int64_t kWide = 16 / L;
inline float reduce_wide(const vfloat* acc, bool tree) {  // tree: reduce()'s order, else lane by lane
#if defined(__AVX512F__)
  const vfloat16 v = acc[0];
#else
  const vfloat16 v = __builtin_shufflevector(acc[0], acc[1], 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#endif
  if (tree) return reduce(v, plus);
  float total = 0.0f;
  for (int64_t i = 0; i < 16; ++i) total += v[i];
  return total;
}

// ---- int8 KV-cache rows (kv_cache_dtype "int8") ----------------------------------------------
// A cache row of D values is D int8 codes followed by its float32 scale (D + 4 bytes; D is a
// multiple of 16, so the scale is 4-byte aligned): value = code * scale, scale = max|x| / 127,
// one per (token, kv head). Symmetric and per row, so a row is written once, by itself, and a
// reader needs no other state; the error is at most half a code, scale / 2.
constexpr int64_t kScaleBytes = 4;

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  __builtin_memcpy(&s, row + D, sizeof s);
  return s;
}
// Stores L integers in [-127, 127] as codes. GCC 12 narrows with scalar byte inserts unless
// AVX-512 gives it vpmovdb; with AVX2 alone, two saturating packs do it.
inline void store_codes(int8_t* p, vint x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m128i lo, hi;
  __builtin_memcpy(&lo, &x, 16);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&x) + 16, 16);
  const __m128i w = _mm_packs_epi32(lo, hi);  // 8 int16, in order
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
#else
  *reinterpret_cast<vbyte_mem*>(p) = __builtin_convertvector(x, vbyte);
#endif
}
// Quantizes x[0 .. nv * L) (nv vectors, already in float) into a cache row.
inline void quantize_row(const vfloat* x, int64_t nv, int8_t* row) {
  vfloat m = {};
  for (int64_t c = 0; c < nv; ++c) m = maximum(m, maximum(x[c], -x[c]));
  const float amax = reduce(m, maximum), scale = amax / 127.0f;
  const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
  for (int64_t c = 0; c < nv; ++c) {  // round half to even (the 1.5 * 2^23 trick; |x * inv| <= 127)
    const vfloat r = (keep(x[c] * inv) + 12582912.0f) - 12582912.0f;
    store_codes(row + c * L, __builtin_convertvector(r, vint));
  }
  const int64_t D = nv * L;
  __builtin_memcpy(row + D, &scale, sizeof scale);
}

}  // namespace rollout_vec
