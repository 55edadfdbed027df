// 16-lane float32 vectors (GCC/Clang vector extensions) shared by the CPU kernels; -march=native
// picks the SIMD instructions (AVX-512 here). Each kernel file adds its own bf16 load/store,
// tuned and rounded for what it must match.
#pragma once

#include <cstdint>
#if defined(__AVX2__) && !defined(__AVX512F__)
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

constexpr int64_t L = 16;  // lanes per vector here (one AVX-512 register)
typedef Lanes<L>::f vfloat;
typedef Lanes<L>::i vint;
typedef Lanes<L>::u vuint;
typedef Lanes<L>::h vhalf;
typedef Lanes<L>::f_mem vfloat_mem;
typedef Lanes<L>::h_mem vhalf_mem;

inline vfloat splat(float x) { return vfloat{} + x; }
inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_mem*>(p); }
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_mem*>(p) = v; }

// Materializes a float32 value: GCC contracts a*b+c into an FMA by default (also across
// statements), which would skip a rounding that torch, computing a*b in a separate kernel, does.
#if defined(__x86_64__) && defined(__AVX512F__)
inline vfloat keep(vfloat x) { asm("" : "+v"(x)); return x; }
#elif defined(__x86_64__) && defined(__AVX__)  // two 8-lane registers (not a trip through memory)
inline vfloat keep(vfloat x) {
  typedef float half __attribute__((vector_size(4 * L / 2)));
  half a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7);
  half b = __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
  asm("" : "+x"(a), "+x"(b));
  return __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
inline vfloat keep(vfloat x) { asm("" : "+m"(x)); return x; }
#endif

// Horizontal reduction of one vector by a fixed tree (lanes i and i + 8, then i and i + 4, ...):
// the same order wherever it is called, which the batch-invariant ops rely on.
template <typename Op>
inline float reduce(vfloat v, Op op) {  // horizontal reduction, log2(L) halving steps
  auto a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7),
              __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  auto b = op(__builtin_shufflevector(a, a, 0, 1, 2, 3), __builtin_shufflevector(a, a, 4, 5, 6, 7));
  auto c = op(__builtin_shufflevector(b, b, 0, 1), __builtin_shufflevector(b, b, 2, 3));
  return op(c[0], c[1]);
}
const auto plus = [](auto a, auto b) { return a + b; };
const auto maximum = [](auto a, auto b) { return a > b ? a : b; };

// ---- int8 KV-cache rows (kv_cache_dtype "int8") ----------------------------------------------
// A cache row of D values is D int8 codes followed by its float32 scale (D + 4 bytes; D is a
// multiple of 16, so the scale is 4-byte aligned): value = code * scale, scale = max|x| / 127,
// one per (token, kv head). Symmetric and per row, so a row is written once, by itself, and a
// reader needs no other state; the error is at most half a code, scale / 2.
constexpr int64_t kScaleBytes = 4;
typedef Lanes<L>::b vbyte;
typedef Lanes<L>::b_mem vbyte_mem;

inline float row_scale(const int8_t* row, int64_t D) {
  float s;
  __builtin_memcpy(&s, row + D, sizeof s);
  return s;
}
// Stores 16 integers in [-127, 127] as codes. GCC 12 narrows with 16 scalar byte inserts unless
// AVX-512 gives it vpmovdb; with AVX2 alone, two saturating packs do it.
inline void store_codes(int8_t* p, vint x) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  __m256i lo, hi;
  __builtin_memcpy(&lo, &x, 32);
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&x) + 32, 32);
  const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);  // 16 int16, in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
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
