// float32 -> bfloat16 bits, rounded to nearest even and NaN made a quiet NaN, as torch's cast
// rounds: in integer arithmetic, because AVX-512 BF16's own convert flushes denormals. For the
// packs and copies that cast a trainer's float32 weights on the way (spare_write.cpp, vnni_linear.cpp,
// f32_linear.cpp).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
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

#if defined(__AVX2__)
// 8 floats (their bits) -> 8 bfloat16, the same rounding at AVX2's width
inline __m128i round8(__m256i u) {
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));  // (signed compare: both are >= 0)
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)),
                               _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1)));
  r = _mm256_blendv_epi8(_mm256_srli_epi32(r, 16), _mm256_set1_epi32(0x7fc0), nan);
  // each 128-bit lane packs its 4 values (all <= 0xffff: no saturation), then the lanes' halves meet
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
#endif

}  // namespace rollout_bf16
