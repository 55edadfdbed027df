// 16-lane float32 vectors (GCC/Clang vector extensions) shared by the CPU kernels; -march=native
// picks the SIMD instructions (AVX-512 here). Each kernel file adds its own bf16 load/store,
// tuned and rounded for what it must match.
#pragma once

#include <cstdint>

namespace rollout_vec {

constexpr int64_t L = 16;  // lanes per vector
typedef float vfloat __attribute__((vector_size(4 * L)));
typedef int32_t vint __attribute__((vector_size(4 * L)));
typedef uint32_t vuint __attribute__((vector_size(4 * L)));
typedef uint16_t vhalf __attribute__((vector_size(2 * L)));
// Unaligned, aliasing views for loads and stores anywhere in float / bf16 arrays. (Not memcpy:
// with -march=native GCC splits a 64-byte memcpy in two and then stalls on store forwarding.)
typedef float vfloat_mem __attribute__((vector_size(4 * L), aligned(4), may_alias));
typedef uint16_t vhalf_mem __attribute__((vector_size(2 * L), aligned(2), may_alias));

inline vfloat splat(float x) { return vfloat{} + x; }
inline vfloat load(const float* p) { return *reinterpret_cast<const vfloat_mem*>(p); }
inline void store(float* p, vfloat v) { *reinterpret_cast<vfloat_mem*>(p) = v; }

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

}  // namespace rollout_vec
