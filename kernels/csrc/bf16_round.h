// float32 -> bfloat16 bits, rounded to nearest even and NaN made a quiet NaN, as torch's cast
// rounds: in integer arithmetic, because AVX-512 BF16's own convert flushes denormals. For the
// packs and copies that cast a trainer's float32 weights on the way (spare_write.cpp, vnni_linear.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace rollout_bf16 {

inline uint16_t round_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return nan ? uint16_t{0x7fc0} : static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512BW__)
// 16 floats (their bits) -> 16 bfloat16
inline __m256i round16(__m512i u) {
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                     _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)));
  return _mm256_mask_blend_epi16(nan, _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)), _mm256_set1_epi16(0x7fc0));
}
#endif

}  // namespace rollout_bf16
