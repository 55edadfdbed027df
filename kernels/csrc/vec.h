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

}  // namespace rollout_vec
