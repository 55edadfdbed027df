// Fused CPU ops for the decoder's small per-layer steps, one call each instead of a chain of
// torch ops (float32 and bfloat16; all math in float32):
//
//   fused_add_rms_norm(x, residual|None, weight, eps) -> (normed, new_residual)
//   rms_norm(x, weight, eps) -> normed                    (x: 1-3 dims, last dim contiguous)
//   silu_and_mul(gate_up) -> silu(gate) * up             (gate_up: (T, 2I), last dim contiguous)
//   rope_and_cache(qkv, positions, cos_sin, k_cache, v_cache, slot_mapping, Hq, Hkv, D,
//                  q_norm=None, k_norm=None, eps=1e-6) -> (q, k)
//   rope_and_cache_qk(q, k, v, positions, cos_sin, k_cache, v_cache, slot_mapping) -> (q, k)
//                  (both: caches of the activations' dtype, or int8 rows of codes and a scale, vec.h)
//   greedy_logprobs(logits (N, V), with_logprobs) -> (argmax ids (N,), their log-softmax (N,))
//   logsumexp_rows(x (N, V)) -> (N,)                    (batch-invariant: one fixed order per row)
//   sample_rows(logits (N, V), temperature (N,), u (N,), with_logprobs) -> (ids (N,), logprobs (N,))
//
// Rounding points follow the torch ops of Hugging Face's Llama (see kernels/norm.py,
// kernels/activation.py, kernels/rotary.py for the reference formulas): a bf16 result is rounded
// (round-to-nearest-even, like c10::BFloat16) wherever the torch chain materializes a bf16
// tensor, and float32 intermediates are kept un-fused wherever torch computes them in separate
// kernels (keep() blocks GCC's default a*b+c -> FMA contraction). Beyond that the ops follow
// ATen's own kernels, so results are bit-identical to the torch references on AVX-512 and AVX2
// CPUs (each runs ATen's build for its own width, and these ops work at the same width, vec.h):
//   - the sum of squares of an RMSNorm row is added in the order of ATen's cascade_sum (the
//     inner-contiguous sum kernel behind `x.pow(2).mean(-1)`; 8-lane vectors, see sum_squares);
//   - silu uses SLEEF's expf_u10 algorithm (what ATen's vectorized silu calls) and libm's expf
//     for the elements ATen leaves to its scalar tail loop (the last I % (2 * vector width)
//     of each row).
// (ATen's kernels differ across builds and CPUs: elsewhere an ulp may differ now and then.)
// The sampling sums (greedy and sampled logprobs, the CDF, logsumexp_rows) are taken in 16-lane
// order on every target (vec.h reduce_wide), so a seeded draw picks the same token on both.
//
// Threading: a call estimated at under ~5 us of work runs on the calling thread (waking a
// second thread costs about as much, and a descheduled sibling thread stalls the call for a
// time slice); larger ones split their rows with at::parallel_for (measured: 2 threads save
// 25-40% from ~5 us of work on).
//
// Declared in ops.h, bound to Python in bindings.cpp.
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>  // a few AVX-512 intrinsics, each with a generic fallback
#endif

#include "ops.h"
#include "vec.h"

namespace rollout_fused {
namespace {

using namespace rollout_vec;
using rollout_vec::load;  // overloaded below for bf16
using rollout_vec::store;
using bf16 = c10::BFloat16;

// Work estimates, in units of ~0.1 ns of one core (measured on an AVX-512 + AMX Xeon): below
// kParallelWork a call is single-threaded.
constexpr int64_t kParallelWork = 50000;
inline int64_t per_elem(at::ScalarType t, int64_t bf16_cost, int64_t f32_cost) {
  return t == at::kBFloat16 ? bf16_cost : f32_cost;
}
constexpr int64_t kMaxHeadDim = 512;

inline vfloat load(const bf16* p) {  // bf16 -> f32: widen (vpmovzxwd) and shift
#if defined(__AVX512F__)  // (GCC splits the generic convertvector into 256-bit halves)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (vfloat)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
#else
  return (vfloat)(__builtin_convertvector(*reinterpret_cast<const vhalf_mem*>(p), vuint) << 16);
#endif
}
inline vuint bf16_round(vfloat v) {  // f32 -> bf16 rounding like c10::BFloat16, as f32 bits
  const vuint u = (vuint)v, rounded = (u + ((u >> 16) & 1) + 0x7FFF) & 0xFFFF0000u;
  return v != v ? vuint{} + 0x7FC00000u : rounded;  // NaN -> canonical quiet NaN
}
inline void store(bf16* p, vfloat v) {
#if defined(__AVX512F__)  // (vpmovdw; GCC's generic narrowing is a two-register permute)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32((__m512i)bf16_round(v), 16)));
#else
  *reinterpret_cast<vhalf_mem*>(p) = __builtin_convertvector(bf16_round(v) >> 16, vhalf);
#endif
}

// Partial vectors (n < L elements; the other lanes load as 0).
template <typename T>
inline vfloat load_n(const T* p, int64_t n) {
  T tmp[L];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, n * sizeof(T));
  return load(tmp);
}
template <typename T>
inline void store_n(T* p, vfloat v, int64_t n) {
  T tmp[L];
  store(tmp, v);
  std::memcpy(static_cast<void*>(p), tmp, n * sizeof(T));
}
template <typename T>
inline vfloat load_k(const T* p, int64_t n) { return n == L ? load(p) : load_n(p, n); }
template <typename T>
inline void store_k(T* p, vfloat v, int64_t n) {
  if (n == L) store(p, v);
  else store_n(p, v, n);
}

// 8-lane vectors, for ATen's 8-lane sums.
inline vfloat8 load8(const float* p) { return *reinterpret_cast<const Lanes<8>::f_mem*>(p); }
inline vfloat8 load8(const bf16* p) {
  return (vfloat8)(__builtin_convertvector(*reinterpret_cast<const Lanes<8>::h_mem*>(p), Lanes<8>::u) << 16);
}

// The value of a float32 result once stored in T: bf16 rounding, or float32 itself (kept
// un-fused, see keep()).
template <typename T>
inline vfloat round_to(vfloat v) {
  if constexpr (std::is_same_v<T, float>) return keep(v);
  else return (vfloat)bf16_round(v);
}
template <typename T>
inline float round_to(float v) {
  if constexpr (std::is_same_v<T, float>) return keep(v);
  else return static_cast<float>(static_cast<bf16>(v));
}

// exp(x) exactly as SLEEF's Sleef_expf16_u10 / Sleef_expf8_u10 (ATen's Vectorized<float>::exp()):
// Cody-Waite reduction by ln 2 and a degree-6 polynomial, with FMAs where SLEEF has them.
inline vfloat sleef_expf(vfloat d) {
  const vfloat t = keep(d * 1.442695040888963407359924681001892137426645954152985934135449406931f);
  const vfloat qf = (t + 12582912.0f) - 12582912.0f;  // rint (ties to even), |t| < 2^22
  const vint q = __builtin_convertvector(qf, vint);
  vfloat s = d - qf * 0.693145751953125f;  // fma
  s = s - qf * 1.428606765330187045e-06f;  // fma
  vfloat u = splat(0.000198527617612853646278381f);
  u = u * s + 0.00139304355252534151077271f;  // each an fma
  u = u * s + 0.00833336077630519866943359f;
  u = u * s + 0.0416664853692054748535156f;
  u = u * s + 0.166666671633720397949219f;
  u = u * s + 0.5f;
  u = 1.0f + (keep(s * s) * u + s);
  const vint q1 = q >> 1, q2 = q - q1;  // ldexp in two steps: 2^q1 * 2^q2
  u = keep(u * (vfloat)((q1 + 127) << 23)) * (vfloat)((q2 + 127) << 23);
  u = (vfloat)((vint)u & ~(vint)(d < -104.0f));
  u = 100.0f < d ? splat(__builtin_inff()) : u;
  return (vfloat)((vint)u | (vint)(d != d));
}

// sum_i p[i]^2 (each square rounded to float32, like x.pow(2)) in the order of ATen's
// cascade_sum for an inner-contiguous row: ATen runs its AVX2 build of the sum kernel (8-lane
// vectors) even on AVX-512 CPUs. The row is n / 8 vectors of 8 summed by row_sum (4 interleaved
// accumulators through multi_row_sum's 4-level cascade, then the 0-3 leftover vectors into
// accumulator 0, then accumulators 1-3 into 0), then the n % 8 scalar tail from 0, then the 8
// lanes one by one. With L = 8 our vectors are ATen's; with L = 16 one holds two of them, so
// A[level][0] = [acc0 | acc1] takes the even vectors and A[level][1] = [acc2 | acc3] the odd ones.
// (Adding a level's zeros, as ATen does for unused levels, changes nothing: the partial sums are
// >= 0.) Rows of n < 8, which ATen sums with its scalar loop, may differ in the last bit.
inline int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(uint64_t(x - 1)); }

template <typename T>
float sum_squares(const T* p, int64_t n) {
  constexpr int64_t K = 8;          // ATen's lanes
  constexpr int64_t P = 4 * K / L;  // our vectors per group of ATen's 4
  const int64_t nk = n / K, n4 = nk / 4;  // 8-lane vectors; groups of 4
  auto sq = [p](int64_t i) {  // squares of the i-th vector
    const vfloat v = load(p + i * L);
    return keep(v * v);
  };
  vfloat A[4][P] = {};  // by level, then accumulator
  const int64_t power = std::max<int64_t>(4, ceil_log2(n4) / 4);
  const int64_t step = int64_t(1) << power, mask = step - 1;
  int64_t i = 0;
  while (i + step <= n4) {  // (rows of >= 512 elements)
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < P; ++k) A[0][k] += sq(P * i + k);
    for (int64_t k = 0; k < P; ++k) A[1][k] += A[0][k], A[0][k] = vfloat{};
    if (i & (mask << power)) continue;
    for (int64_t k = 0; k < P; ++k) A[2][k] += A[1][k], A[1][k] = vfloat{};
    if (i & (mask << (2 * power))) continue;
    for (int64_t k = 0; k < P; ++k) A[3][k] += A[2][k], A[2][k] = vfloat{};
  }
  for (; i < n4; ++i)
    for (int64_t k = 0; k < P; ++k) A[0][k] += sq(P * i + k);
  for (int64_t k = 0; k < P; ++k) A[0][k] = ((A[0][k] + A[1][k]) + A[2][k]) + A[3][k];
#if defined(__AVX512F__)
  auto half = [](vfloat v, int64_t h) {
    return h ? __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15)
             : __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
  };
  vfloat8 acc[4] = {half(A[0][0], 0), half(A[0][0], 1), half(A[0][1], 0), half(A[0][1], 1)};
#else
  vfloat8 acc[4] = {A[0][0], A[0][1], A[0][2], A[0][3]};
#endif
  for (int64_t v = 4 * n4; v < nk; ++v) {  // the 0-3 leftover 8-lane vectors
    const vfloat8 x = load8(p + v * K);
    acc[0] += keep(x * x);
  }
  acc[0] = ((acc[0] + acc[1]) + acc[2]) + acc[3];
  float total = 0.0f;
  for (int64_t e = nk * K; e < n; ++e) {
    const float x = static_cast<float>(p[e]);
    total += keep(x * x);
  }
  for (int64_t l = 0; l < K; ++l) total += acc[0][l];
  return total;
}

// 1 / sqrt(mean(x^2) + eps) as torch.rsqrt(x.pow(2).mean(-1) + eps).
template <typename T>
inline float inv_rms(const T* p, int64_t n, float eps) {
  const float var = sum_squares(p, n) / static_cast<float>(n);
  return 1.0f / std::sqrt(var + eps);
}

// dst = weight * to_T(src * inv) over n elements (HF LlamaRMSNorm after the statistics).
template <typename T>
inline void scale_row(const T* src, const T* w, float inv, T* dst, int64_t n) {
  for (int64_t c = 0; c < n; c += L) {
    const int64_t m = std::min(L, n - c);
    store_k(dst + c, load_k(w + c, m) * round_to<T>(load_k(src + c, m) * inv), m);
  }
}

// Runs fn(r0, r1) over rows [0, n_rows): inline below kParallelWork (work units) in all,
// else split with at::parallel_for.
template <typename F>
inline void for_rows(int64_t n_rows, int64_t work_per_row, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, kParallelWork / std::max<int64_t>(1, work_per_row));
  if (n_rows <= grain || at::get_num_threads() == 1) fn(int64_t(0), n_rows);
  else at::parallel_for(0, n_rows, grain, fn);
}

inline at::Tensor new_tensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::Tensor(at::detail::empty_cpu(sizes, dtype));
}

inline bool dtype_ok(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16; }

template <typename F>
inline void dispatch_dtype(at::ScalarType t, const char* name, const F& fn) {
  if (t == at::kFloat) fn(float{});
  else if (t == at::kBFloat16) fn(bf16{});
  else TORCH_CHECK(false, name, ": float32 or bfloat16 only, got ", t);
}

// ---- RMSNorm --------------------------------------------------------------------------------

template <typename T>
void add_rms_norm_rows(const T* x, int64_t x_stride, const T* res, int64_t res_stride,
                       T* new_res, const T* w, T* out, int64_t H, float eps, int64_t r0,
                       int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const T* src = x + r * x_stride;
    if (res) {  // new_res = to_T(res + x): torch's bf16 add rounds the float32 sum once
      const T* rr = res + r * res_stride;
      T* nr = new_res + r * H;
      for (int64_t c = 0; c < H; c += L) {
        const int64_t m = std::min(L, H - c);
        store_k(nr + c, load_k(rr + c, m) + load_k(src + c, m), m);
      }
      src = nr;  // normalize the rounded sum
    }
    scale_row(src, w, inv_rms(src, H, eps), out + r * H, H);
  }
}

void check_norm_weight(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(dtype_ok(x.scalar_type()), name, ": float32 or bfloat16 only, got ",
              x.scalar_type());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight dtype ",
              weight.scalar_type(), " != input dtype ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.stride(0) == 1, name,
              ": weight must be a contiguous (", x.size(-1), ",) tensor");
  TORCH_CHECK(x.size(-1) <= 1 || x.stride(-1) == 1, name, ": the last dim must be contiguous");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const std::optional<at::Tensor>& residual,
                                                      const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2, "fused_add_rms_norm: x must be (T, H)");
  check_norm_weight(x, weight, "fused_add_rms_norm");
  const int64_t T = x.size(0), H = x.size(1);
  const bool has_res = residual.has_value();
  if (has_res) {
    const at::Tensor& r = *residual;
    TORCH_CHECK(r.device().is_cpu() && r.scalar_type() == x.scalar_type() && r.dim() == 2 &&
                    r.size(0) == T && r.size(1) == H && (H <= 1 || r.stride(1) == 1),
                "fused_add_rms_norm: residual must match x (T, H) with a contiguous last dim");
  }
  at::Tensor out = new_tensor({T, H}, x.scalar_type());
  at::Tensor new_res = has_res ? new_tensor({T, H}, x.scalar_type()) : x;
  const float e = static_cast<float>(eps);
  dispatch_dtype(x.scalar_type(), "fused_add_rms_norm", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    const T_* rp = has_res ? residual->data_ptr<T_>() : nullptr;
    T_* np = has_res ? new_res.data_ptr<T_>() : nullptr;
    const T_* wp = weight.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    const int64_t xs = x.stride(0), rs = has_res ? residual->stride(0) : 0;
    for_rows(T, H * per_elem(x.scalar_type(), 3, has_res ? 2 : 1), [&](int64_t r0, int64_t r1) {
      add_rms_norm_rows(xp, xs, rp, rs, np, wp, op, H, e, r0, r1);
    });
  });
  return {out, new_res};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 3, "rms_norm: x must have 1 to 3 dims");
  check_norm_weight(x, weight, "rms_norm");
  // Rows (a, b) of a (A, B, H) view at a * s0 + b * s1.
  const int64_t H = x.size(-1);
  const int64_t A = x.dim() >= 2 ? x.size(0) : 1, B = x.dim() == 3 ? x.size(1) : 1;
  const int64_t s0 = x.dim() >= 2 ? x.stride(0) : 0, s1 = x.dim() == 3 ? x.stride(1) : 0;
  at::Tensor out = new_tensor(x.sizes(), x.scalar_type());
  const float e = static_cast<float>(eps);
  dispatch_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* xp = x.data_ptr<T_>();
    const T_* wp = weight.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    for_rows(A * B, H * per_elem(x.scalar_type(), 3, 1), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const T_* src = xp + (r / B) * s0 + (r % B) * s1;
        scale_row(src, wp, inv_rms(src, H, e), op + r * H, H);
      }
    });
  });
  return out;
}

// ---- SiLU and multiply ----------------------------------------------------------------------

namespace {

inline vfloat silu(vfloat x) { return x / (1.0f + keep(sleef_expf(-x))); }  // as ATen's vector path

#if defined(__AVX512F__)
// bf16 has 65536 values: silu of each, as the bf16 bits of ATen's vectorized result, plus one
// padding entry (the gather reads 4 bytes). Built once, on first use (~0.1 ms).
const uint16_t* silu_bf16_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 2);
    vuint bits;
    for (int64_t i = 0; i < L; ++i) bits[i] = i;
    for (int64_t i = 0; i < 65536; i += L, bits += L)
      store(reinterpret_cast<bf16*>(t.data() + i), silu((vfloat)(bits << 16)));
    return t;
  }();
  return table.data();
}
#endif

template <typename T>
void silu_mul_rows(const T* gu, int64_t stride, T* out, int64_t I, int64_t r0, int64_t r1) {
  // ATen's vectorized loop takes 2 vectors (32 floats / 64 bf16 on AVX-512, half that on AVX2)
  // per step and leaves the rest of each row to its scalar lambda, which calls libm's expf.
  constexpr int64_t kStep = 2 * L * static_cast<int64_t>(sizeof(float) / sizeof(T));
  const int64_t n_vec = I - I % kStep;
#if defined(__AVX512F__)
  const uint16_t* table = std::is_same_v<T, bf16> ? silu_bf16_table() : nullptr;
#endif
  for (int64_t r = r0; r < r1; ++r) {
    const T* g = gu + r * stride;
    const T* u = g + I;
    T* o = out + r * I;
    for (int64_t c = 0; c < n_vec; c += L) {
      vfloat s;  // F.silu's result, in T
      if constexpr (std::is_same_v<T, bf16>) {
#if defined(__AVX512F__)
        // A table lookup is ~2x faster than the exp + division.
        const __m512i idx = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
            reinterpret_cast<const __m256i*>(g + c)));  // the bf16 bits, zero-extended
        // A gather merges into its destination register, so it waits for that register's old
        // value. With a known all-ones mask GCC drops the merge source and reuses the previous
        // iteration's register, serializing the gathers (1.5x slower): hide the mask's value so
        // that each gather merges into a fresh zero.
        __mmask16 all = 0xFFFF;
        asm("" : "+k"(all));
        const vuint t =
            (vuint)_mm512_mask_i32gather_epi32(_mm512_setzero_si512(), all, idx, table, 2);
        s = (vfloat)(t << 16);
#else
        s = round_to<T>(silu(load(g + c)));
#endif
      } else {
        s = round_to<T>(silu(load(g + c)));
      }
      store(o + c, s * load(u + c));
    }
    for (int64_t c = n_vec; c < I; ++c) {
      const float x = static_cast<float>(g[c]);
      const float s = round_to<T>(x / (1.0f + keep(std::exp(-x))));
      o[c] = static_cast<T>(s * static_cast<float>(u[c]));
    }
  }
}

}  // namespace

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_and_mul: CPU tensors only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 &&
                  (gate_up.size(1) <= 1 || gate_up.stride(1) == 1),
              "silu_and_mul: gate_up must be (T, 2I) with a contiguous last dim");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2;
  at::Tensor out = new_tensor({T, I}, gate_up.scalar_type());
  dispatch_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* gp = gate_up.data_ptr<T_>();
    T_* op = out.data_ptr<T_>();
    const int64_t s = gate_up.stride(0);
    for_rows(T, I * per_elem(gate_up.scalar_type(), 3, 4),
             [&](int64_t r0, int64_t r1) { silu_mul_rows(gp, s, op, I, r0, r1); });
  });
  return out;
}

// ---- RoPE + KV-cache write ------------------------------------------------------------------

namespace {

struct HeadView {  // (T, H, D) with element strides s0, s1 and a contiguous last dim
  const void* p;
  int64_t s0, s1;
};

struct RopeArgs {
  HeadView q, k, v;
  const void* q_w;  // optional per-head RMSNorm weights (D,), applied before the rotation
  const void* k_w;
  float eps;
  const int64_t* pos;
  const float* cos_sin;  // (max_pos, 2, D/2)
  const int64_t* slots;
  void* k_cache;  // (num_blocks * block_size, Hkv, D) contiguous, of T; or of int8 rows (D + 4: vec.h)
  void* v_cache;
  bool codes;     // the caches hold int8 rows: quantize what would be stored
  void* q_out;  // (T, Hq, D)
  void* k_out;  // (T, Hkv, D)
  int64_t Hq, Hkv, D;
};

// One head row: optional RMSNorm (w != null; inv = its 1 / rms), then the rotate-half rotation
// in T's rounding: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, every product and sum
// rounded to T. Stores into dst and, if given, dst2 (the cache row). NH = vectors per half row
// when fixed at compile time (D = 64, 128), else 0 (partial vectors allowed).
template <typename T, int64_t NH>
inline void rope_head(const T* src, const T* w, float inv, const vfloat* cosv, const vfloat* sinv,
                      int64_t half, T* dst, T* dst2) {
  constexpr int64_t kMax = NH > 0 ? NH : kMaxHeadDim / 2 / L;
  const int64_t nh = NH > 0 ? NH : (half + L - 1) / L;
  vfloat x1[kMax], x2[kMax];
  for (int64_t i = 0; i < nh; ++i) {
    const int64_t m = NH > 0 ? L : std::min(L, half - i * L);
    x1[i] = load_k(src + i * L, m), x2[i] = load_k(src + half + i * L, m);
    if (w) {  // HF: weight * to_T(x * inv), in T
      x1[i] = round_to<T>(load_k(w + i * L, m) * round_to<T>(x1[i] * inv));
      x2[i] = round_to<T>(load_k(w + half + i * L, m) * round_to<T>(x2[i] * inv));
    }
  }
  for (int64_t i = 0; i < nh; ++i) {
    const int64_t m = NH > 0 ? L : std::min(L, half - i * L);
    const vfloat o1 = round_to<T>(x1[i] * cosv[i]) - round_to<T>(x2[i] * sinv[i]);
    const vfloat o2 = round_to<T>(x2[i] * cosv[i]) + round_to<T>(x1[i] * sinv[i]);
    store_k(dst + i * L, o1, m);
    store_k(dst + half + i * L, o2, m);
    if (dst2) {
      store_k(dst2 + i * L, o1, m);
      store_k(dst2 + half + i * L, o2, m);
    }
  }
}

// An int8 cache row from D values of T (D % 16 == 0, checked).
template <typename T>
inline void quantize_head(const T* src, int64_t D, int8_t* row) {
  vfloat x[kMaxHeadDim / L];
  for (int64_t c = 0; c < D / L; ++c) x[c] = load(src + c * L);
  quantize_row(x, D / L, row);
}

template <typename T, int64_t NH>
void rope_rows(const RopeArgs& a, int64_t t0, int64_t t1) {
  const int64_t D = a.D, half = D / 2, Hq = a.Hq, Hkv = a.Hkv;
  const int64_t kv_row = Hkv * (a.codes ? D + kScaleBytes : D);  // a token's cache elements
  const T* q = static_cast<const T*>(a.q.p);
  const T* k = static_cast<const T*>(a.k.p);
  const T* v = static_cast<const T*>(a.v.p);
  const T* qw = static_cast<const T*>(a.q_w);
  const T* kw = static_cast<const T*>(a.k_w);
  T* kc = static_cast<T*>(a.k_cache);
  T* vc = static_cast<T*>(a.v_cache);
  T* qo = static_cast<T*>(a.q_out);
  T* ko = static_cast<T*>(a.k_out);
  vfloat cosv[kMaxHeadDim / 2 / L], sinv[kMaxHeadDim / 2 / L];
  std::vector<float> inv(qw ? Hq + Hkv : 0, 1.0f);
  for (int64_t t = t0; t < t1; ++t) {
    // cos / sin of this position, rounded to T (HF casts them to the activations' dtype).
    const float* cs = a.cos_sin + a.pos[t] * D;
    for (int64_t c = 0, i = 0; c < half; c += L, ++i) {
      const int64_t m = std::min(L, half - c);
      cosv[i] = round_to<T>(load_k(cs + c, m));
      sinv[i] = round_to<T>(load_k(cs + half + c, m));
    }
    if (qw) {  // all the heads' statistics first: independent chains the CPU can overlap
      for (int64_t h = 0; h < Hq; ++h) inv[h] = inv_rms(q + t * a.q.s0 + h * a.q.s1, D, a.eps);
      for (int64_t h = 0; h < Hkv; ++h)
        inv[Hq + h] = inv_rms(k + t * a.k.s0 + h * a.k.s1, D, a.eps);
    }
    for (int64_t h = 0; h < Hq; ++h)
      rope_head<T, NH>(q + t * a.q.s0 + h * a.q.s1, qw, inv.empty() ? 1.0f : inv[h], cosv, sinv,
                       half, qo + (t * Hq + h) * D, static_cast<T*>(nullptr));
    const int64_t slot = a.slots[t];
    if (a.codes) {  // the rotated k (in T's rounding, as stored otherwise) and v, quantized per row
      int8_t* kq = static_cast<int8_t*>(a.k_cache) + slot * kv_row;
      int8_t* vq = static_cast<int8_t*>(a.v_cache) + slot * kv_row;
      for (int64_t h = 0; h < Hkv; ++h) {
        T* k_row = ko + (t * Hkv + h) * D;
        rope_head<T, NH>(k + t * a.k.s0 + h * a.k.s1, kw, inv.empty() ? 1.0f : inv[Hq + h], cosv, sinv, half,
                         k_row, static_cast<T*>(nullptr));
        quantize_head(k_row, D, kq + h * (D + kScaleBytes));
        quantize_head(v + t * a.v.s0 + h * a.v.s1, D, vq + h * (D + kScaleBytes));
      }
      continue;
    }
    for (int64_t h = 0; h < Hkv; ++h)
      rope_head<T, NH>(k + t * a.k.s0 + h * a.k.s1, kw, inv.empty() ? 1.0f : inv[Hq + h], cosv,
                       sinv, half, ko + (t * Hkv + h) * D, kc + slot * kv_row + h * D);
    for (int64_t h = 0; h < Hkv; ++h)
      std::memcpy(static_cast<void*>(vc + slot * kv_row + h * D), v + t * a.v.s0 + h * a.v.s1,
                  D * sizeof(T));
  }
}

// Checks shared by both entry points; fills the pointers and allocates q_out / k_out.
std::tuple<at::Tensor, at::Tensor> rope_and_cache_impl(
    RopeArgs& a, at::ScalarType dtype, int64_t T, const at::Tensor& positions,
    const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double eps) {
  const char* name = "rope_and_cache";
  const int64_t D = a.D, Hkv = a.Hkv;
  TORCH_CHECK(dtype_ok(dtype), name, ": float32 or bfloat16 only, got ", dtype);
  TORCH_CHECK(D % 2 == 0 && D >= 2 && D <= kMaxHeadDim, name, ": head_dim must be even, <= ",
              kMaxHeadDim);
  for (const auto* t : {&positions, &cos_sin, &k_cache, &v_cache, &slot_mapping})
    TORCH_CHECK(t->device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1 &&
                  positions.size(0) == T && positions.is_contiguous(),
              name, ": positions must be a contiguous int64 (T,) tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == T && slot_mapping.is_contiguous(),
              name, ": slot_mapping must be a contiguous int64 (T,) tensor");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.dim() == 3 && cos_sin.size(1) == 2 &&
                  cos_sin.size(2) == D / 2 && cos_sin.is_contiguous(),
              name, ": cos_sin must be a contiguous float32 (max_pos, 2, head_dim/2) tensor");
  const bool codes = k_cache.scalar_type() == at::kChar;
  const int64_t row = codes ? D + kScaleBytes : D;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.size(2) == Hkv && k_cache.size(3) == row && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              name, ": k_cache/v_cache must be contiguous (num_blocks, block_size, ", Hkv, ", ",
              row, ") tensors");
  TORCH_CHECK((k_cache.scalar_type() == dtype || codes) && v_cache.scalar_type() == k_cache.scalar_type(), name,
              ": the caches must have the activations' dtype, or both be int8 (rows of codes and a scale)");
  TORCH_CHECK(!codes || D % 16 == 0, name, ": an int8 cache needs a head_dim that is a multiple of 16");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), name,
              ": give both q_norm and k_norm or neither");
  for (const auto* w : {&q_norm, &k_norm})
    if (w->has_value())
      TORCH_CHECK((*w)->device().is_cpu() && (*w)->scalar_type() == dtype && (*w)->dim() == 1 &&
                      (*w)->size(0) == D && (*w)->stride(0) == 1,
                  name, ": q_norm/k_norm must be contiguous (head_dim,) tensors of the dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0), n_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, name, ": positions[", t, "] = ", pos[t],
                " out of range [0, ", max_pos, ")");
    TORCH_CHECK(slots[t] >= 0 && slots[t] < n_slots, name, ": slot_mapping[", t, "] = ",
                slots[t], " out of range [0, ", n_slots, ")");
  }
  at::Tensor q_out = new_tensor({T, a.Hq, D}, dtype);
  at::Tensor k_out = new_tensor({T, Hkv, D}, dtype);
  a.pos = pos, a.slots = slots, a.cos_sin = cos_sin.data_ptr<float>();
  a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr(), a.codes = codes;
  a.q_out = q_out.data_ptr(), a.k_out = k_out.data_ptr();
  a.q_w = q_norm ? (*q_norm).data_ptr() : nullptr;
  a.k_w = k_norm ? (*k_norm).data_ptr() : nullptr;
  a.eps = static_cast<float>(eps);
  const int64_t work =
      (a.Hq + 2 * Hkv) * D * (a.q_w ? per_elem(dtype, 6, 3) : per_elem(dtype, 3, 2));
  dispatch_dtype(dtype, name, [&](auto tag) {
    using T_ = decltype(tag);
    auto run = [&](auto kernel) {
      for_rows(T, work, [&](int64_t t0, int64_t t1) { kernel(a, t0, t1); });
    };
    if (D == 64) run(rope_rows<T_, 32 / L>);
    else if (D == 128) run(rope_rows<T_, 64 / L>);
    else run(rope_rows<T_, 0>);
  });
  return {q_out, k_out};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rope_and_cache(
    const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    double eps) {
  TORCH_CHECK(qkv.device().is_cpu(), "rope_and_cache: CPU tensors only");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0, "rope_and_cache: bad head counts");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim &&
                  qkv.stride(1) == 1,
              "rope_and_cache: qkv must be (T, (num_heads + 2 * num_kv_heads) * head_dim) "
              "with a contiguous last dim");
  const int64_t T = qkv.size(0), D = head_dim, s0 = qkv.stride(0);
  const size_t esize = qkv.element_size();
  const char* base = static_cast<const char*>(qkv.data_ptr());
  RopeArgs a{};
  a.q = {base, s0, D};
  a.k = {base + num_heads * D * esize, s0, D};
  a.v = {base + (num_heads + num_kv_heads) * D * esize, s0, D};
  a.Hq = num_heads, a.Hkv = num_kv_heads, a.D = D;
  return rope_and_cache_impl(a, qkv.scalar_type(), T, positions, cos_sin, k_cache, v_cache,
                             slot_mapping, q_norm, k_norm, eps);
}

std::tuple<at::Tensor, at::Tensor> rope_and_cache_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
    const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 &&
                    t->scalar_type() == q.scalar_type(),
                "rope_and_cache_qk: q, k, v must be (T, heads, head_dim) tensors of one dtype "
                "with a contiguous last dim");
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && k.size(2) == D && v.size(2) == D &&
                  v.size(1) == k.size(1),
              "rope_and_cache_qk: q (T, Hq, D), k and v (T, Hkv, D) shapes disagree");
  RopeArgs a{};
  a.q = {q.data_ptr(), q.stride(0), q.stride(1)};
  a.k = {k.data_ptr(), k.stride(0), k.stride(1)};
  a.v = {v.data_ptr(), v.stride(0), v.stride(1)};
  a.Hq = q.size(1), a.Hkv = k.size(1), a.D = D;
  return rope_and_cache_impl(a, q.scalar_type(), T, positions, cos_sin, k_cache, v_cache,
                             slot_mapping, std::nullopt, std::nullopt, 0.0);
}

// ---- greedy sampling -----------------------------------------------------------------------------
// Per row: the first index of the maximum (torch.argmax; a row with a NaN gives its first NaN,
// as torch does) and its log-softmax, -log(sum_i exp(x_i - max)): one pass over the row for the
// index, a second for the sum, instead of torch's argmax + float cast + logsumexp + gather. A row
// of only -inf gives index 0 and a NaN logprob, like torch.
template <typename T>
inline vfloat row_at(const T* x, int64_t n, int64_t c) {  // the vector at c, lanes past n -inf
  return c + L <= n ? load(x + c) : (lane_ids() < int32_t(n - c) ? load_n(x + c, n - c) : splat(-__builtin_inff()));
}

// The maximum of at(c) over a row's vectors (c = 0, L, ... < n; lanes past n must be -inf) and
// whether any value is NaN.
template <typename At>
inline float row_max(const At& at, int64_t n, bool& has_nan) {
  vfloat mv = splat(-__builtin_inff());
  vint nan = {};
  for (int64_t c = 0; c < n; c += L) {
    const vfloat v = at(c);
    nan |= (v != v);
    mv = v > mv ? v : mv;
  }
  has_nan = false;
  for (int64_t i = 0; i < L; ++i) has_nan |= nan[i] != 0;
  return reduce(mv, maximum);
}

template <typename T>
void greedy_row(const T* x, int64_t n, bool with_logprob, int64_t& id, float& logprob) {
  // One pass: each lane's maximum and the first index that holds it (strictly greater replaces).
  vfloat mv = splat(-__builtin_inff());
  vint mi = lane_ids(), idx = lane_ids(), nan = {};
  for (int64_t c = 0; c < n; c += L, idx += int32_t(L)) {
    const vfloat v = row_at(x, n, c);
    nan |= v != v;
    const vint gt = v > mv;
    mv = gt ? v : mv;
    mi = gt ? idx : mi;
  }
  for (int64_t i = 0; i < L; ++i)
    if (nan[i]) {
      for (int64_t j = 0; j < n; ++j)
        if (float v = static_cast<float>(x[j]); v != v) { id = j, logprob = v; return; }
    }
  const float m = reduce(mv, maximum);
  id = INT64_MAX;  // the first index over the lanes that hold m (a row of only -inf: 0)
  for (int64_t i = 0; i < L; ++i)
    if (mv[i] == m && mi[i] < id) id = mi[i];
  logprob = 0.0f;
  if (!with_logprob) return;
  vfloat sum[kWide] = {};
  for (int64_t c = 0, j = 0; c < n; c += L, ++j) sum[j % kWide] += sleef_expf(row_at(x, n, c) - m);
  const float total = reduce_wide(sum, false);
  logprob = m == -__builtin_inff() ? __builtin_nanf("") : -std::log(total);  // all -inf: NaN, as torch
}

std::tuple<at::Tensor, at::Tensor> greedy_logprobs(const at::Tensor& logits, bool with_logprobs) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  dtype_ok(logits.scalar_type()) && logits.size(1) > 0,
              "greedy_logprobs: logits must be a CPU (N, V) float32/bfloat16 tensor with a "
              "contiguous last dim");
  const int64_t N = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  at::Tensor ids = new_tensor({N}, at::kLong), lps = new_tensor({N}, at::kFloat);
  int64_t* id = ids.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  dispatch_dtype(logits.scalar_type(), "greedy_logprobs", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* x = logits.data_ptr<T_>();
    for_rows(N, V * (with_logprobs ? 4 : 1), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) greedy_row(x + r * stride, V, with_logprobs, id[r], lp[r]);
    });
  });
  return {ids, lps};
}

// ---- sampling without filters --------------------------------------------------------------------
// Per row: x = logits / temperature (float32 division, as torch), then the token where the CDF of
// softmax(x) first exceeds u, searched in two levels as kernels/sampling.py sample_from_probs does
// (sums of kCdfChunk tokens, then the running sum inside the chunk the target falls in), on the
// unnormalized weights exp(x - max), and the token's logprob x_t - max - log(sum). Three passes
// over the row (max; exp sums; one chunk) instead of torch's float32 copy, division, softmax and
// the sampler's sums: no (N, V) temporaries. A row with a NaN gives its first NaN (as greedy);
// one of only -inf gives token 0 and a NaN logprob.
constexpr int64_t kCdfChunk = 1024;  // kernels/sampling.py CDF_CHUNK

template <typename T>
void sample_row(const T* x, int64_t n, float temp, float u, bool with_logprob, std::vector<float>& cum,
                int64_t& id, float& logprob) {
  const vfloat t = splat(temp);
  auto at = [&](int64_t c) { return row_at(x, n, c) / t; };  // lanes past n: -inf
  bool has_nan;
  const float m = row_max(at, n, has_nan);
  if (has_nan) {
    for (int64_t i = 0; i < n; ++i)
      if (float v = static_cast<float>(x[i]); v != v) { id = i, logprob = v; return; }
  }
  if (m == -__builtin_inff()) { id = 0, logprob = __builtin_nanf(""); return; }
  const vfloat mvec = splat(m);
  const int64_t n_chunks = (n + kCdfChunk - 1) / kCdfChunk;
  cum.resize(n_chunks);
  float total = 0.0f;
  for (int64_t ch = 0; ch < n_chunks; ++ch) {  // cum[ch] = sum of the weights of chunks 0..ch
    vfloat sum[kWide] = {};  // (chunks start at multiples of 16: the wide order is the row's)
    for (int64_t c = ch * kCdfChunk, j = 0; c < std::min(n, (ch + 1) * kCdfChunk); c += L, ++j)
      sum[j % kWide] += sleef_expf(at(c) - mvec);
    cum[ch] = total += reduce_wide(sum, true);
  }
  const float target = u * total;
  int64_t ch = 0;
  while (ch < n_chunks - 1 && !(cum[ch] > target)) ++ch;  // searchsorted(right=True), clamped
  const float rest = target - (ch > 0 ? cum[ch - 1] : 0.0f);
  const int64_t c0 = ch * kCdfChunk, c1 = std::min(n, c0 + kCdfChunk);
  id = c1 - 1;  // the sampler's clamp when rounding leaves the target past the chunk
  float run = 0.0f, w_id = -1.0f;
  for (int64_t c = c0; c < c1 && w_id < 0; c += L) {
    const vfloat w = sleef_expf(at(c) - mvec);
    for (int64_t i = 0; i < L && c + i < c1; ++i)
      if ((run += w[i]) > rest) { id = c + i, w_id = w[i]; break; }
  }
  if (w_id < 0) w_id = sleef_expf(splat(static_cast<float>(x[id]) / temp - m))[0];
  if (!(w_id > 0)) {  // as the sampler: a token of probability 0 is replaced by the argmax
    for (int64_t i = 0; i < n; ++i)
      if (static_cast<float>(x[i]) / temp == m) { id = i; break; }
  }
  logprob = with_logprob ? static_cast<float>(x[id]) / temp - m - std::log(total) : 0.0f;
}

std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                                               const at::Tensor& u, bool with_logprobs) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  dtype_ok(logits.scalar_type()) && logits.size(1) > 0,
              "sample_rows: logits must be a CPU (N, V) float32/bfloat16 tensor with a contiguous last dim");
  const int64_t N = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  for (const auto* t : {&temperature, &u})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == N &&
                    t->is_contiguous(),
                "sample_rows: temperature and u must be contiguous float32 (N,) CPU tensors");
  const float* temp = temperature.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  for (int64_t r = 0; r < N; ++r)
    TORCH_CHECK(temp[r] > 0 && up[r] >= 0 && up[r] < 1, "sample_rows: row ", r, " has temperature ", temp[r],
                " (must be > 0) and u ", up[r], " (must be in [0, 1))");
  at::Tensor ids = new_tensor({N}, at::kLong), lps = new_tensor({N}, at::kFloat);
  int64_t* id = ids.data_ptr<int64_t>();
  float* lp = lps.data_ptr<float>();
  dispatch_dtype(logits.scalar_type(), "sample_rows", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* x = logits.data_ptr<T_>();
    for_rows(N, V * 8, [&](int64_t r0, int64_t r1) {
      std::vector<float> cum;
      for (int64_t r = r0; r < r1; ++r) sample_row(x + r * stride, V, temp[r], up[r], with_logprobs, cum, id[r], lp[r]);
    });
  });
  return {ids, lps};
}

// ---- batch-invariant log-softmax -------------------------------------------------------------
// Per row: max + log(sum_i exp(x_i - max)), each row by one thread in one fixed order (torch's
// reductions split a lone row across threads, so a row's logsumexp depends on the batch). A row
// with a NaN gives NaN, one of only -inf gives -inf, one with +inf gives +inf (as torch).
template <typename T>
float logsumexp_row(const T* x, int64_t n) {
  bool has_nan;
  const float m = row_max([&](int64_t c) { return row_at(x, n, c); }, n, has_nan);
  if (has_nan) return __builtin_nanf("");
  if (m == -__builtin_inff() || m == __builtin_inff()) return m;
  vfloat sum[kWide] = {};
  for (int64_t c = 0, j = 0; c < n; c += L, ++j) sum[j % kWide] += sleef_expf(row_at(x, n, c) - m);
  return m + std::log(reduce_wide(sum, true));
}

at::Tensor logsumexp_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 && dtype_ok(x.scalar_type()) &&
                  x.size(1) > 0,
              "logsumexp_rows: x must be a CPU (N, V) float32/bfloat16 tensor with a contiguous "
              "last dim");
  const int64_t N = x.size(0), V = x.size(1), stride = x.stride(0);
  at::Tensor out = new_tensor({N}, at::kFloat);
  float* o = out.data_ptr<float>();
  dispatch_dtype(x.scalar_type(), "logsumexp_rows", [&](auto tag) {
    using T_ = decltype(tag);
    const T_* p = x.data_ptr<T_>();
    for_rows(N, V * 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = logsumexp_row(p + r * stride, V);
    });
  });
  return out;
}

}  // namespace rollout_fused
