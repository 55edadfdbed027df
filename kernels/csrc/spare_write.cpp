// A trainer's write of a weight update into the engine's leased spare (weight_sync/ipc.py
// SpareWriter), in one call:
//
//   write_many(srcs, dsts, packs): each srcs[i] into dsts[i], packed by the pack function
//     packs[i] names ("f32_panel_pack", "bf16_vnni_pack", "bf16_panel_pack": the layout the
//     engine's matmul reads) or, for "", copied (both contiguous, as many elements); a float32
//     source of a bfloat16 destination is cast on the way (a trainer's float32 master weights
//     into a bf16 engine), rounded as torch's cast rounds. A pack's source needs contiguous rows
//     only: a tensor-parallel rank packs its column slice of a row-parallel weight straight from
//     the full tensor it received
//
// Why one call: a push is a few hundred tensors, many of them a few hundred KB, and a parallel
// region per tensor left threads idle at every small one and paid its start each time (packing
// the default model's projections one call each ran at ~80% of the same bytes packed in one
// region). Here every job is cut into units (a pack's panels, a copy's 256 KiB chunks), and
// the threads split the bytes of all of them evenly. The copies stream their stores past the
// cache as the packs do: the spare is not read again until the engine swaps it in, and a
// streamed store skips reading each line before writing it (torch's copy_ does not).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16_round.h"
#include "ops.h"

namespace rollout_spare {
namespace {

constexpr int64_t kPanel = 32;          // output columns per panel, in every layout
constexpr int64_t kChunk = 256 << 10;   // bytes of a copy unit

enum Kind { kCopy, kF32, kVnni, kBf16Panel };

Kind kind_of(const std::string& pack) {
  if (pack.empty()) return kCopy;
  if (pack == "f32_panel_pack") return kF32;
  if (pack == "bf16_vnni_pack") return kVnni;
  if (pack == "bf16_panel_pack") return kBf16Panel;
  TORCH_CHECK(false, "write_many: unknown pack ", pack);
}

// Copies n bytes with streamed stores once dst is at a line boundary (the ends through memcpy).
void stream_copy(char* dst, const char* src, int64_t n) {
#if defined(__AVX512F__) || defined(__AVX2__)
  const int64_t head = std::min<int64_t>(n, (64 - reinterpret_cast<uintptr_t>(dst) % 64) % 64);
  std::memcpy(dst, src, head);
  int64_t i = head;
  for (; i + 64 <= n; i += 64) {
#if defined(__AVX512F__)
    _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(src + i));
#else
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i + 32),
                        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 32)));
#endif
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

struct Unit {
  int64_t job, begin, end;  // panels [begin, end) of a pack, bytes [begin, end) of a copy (elements of a cast)
};

// A float32 -> bfloat16 cast of n values (bf16_round.h). `stream`: the stores skip the cache where
// aligned (a cast into the spare, not read again soon: a cached store reads each line first, a
// third more traffic for a cast, which took 1.6x as long then).
void cast_bf16(const float* src, uint16_t* dst, int64_t n, bool stream = false) {
  int64_t i = 0;
#if defined(__AVX512BW__)
  for (; i + 16 <= n; i += 16) {
    const __m256i v = rollout_bf16::round16(_mm512_loadu_si512(src + i));
    if (stream && reinterpret_cast<uintptr_t>(dst + i) % 32 == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), v);
    }
  }
#elif defined(__AVX2__)
  for (; i + 16 <= n; i += 16) {
    const __m256i v = _mm256_set_m128i(
        rollout_bf16::round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i + 8))),
        rollout_bf16::round8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    if (stream && reinterpret_cast<uintptr_t>(dst + i) % 32 == 0) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), v);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), v);
    }
  }
#endif
  for (; i < n; ++i) dst[i] = rollout_bf16::round_bits(src[i]);
}

bool casts(const at::Tensor& s, const at::Tensor& d) {
  return s.scalar_type() == at::kFloat && d.scalar_type() == at::kBFloat16;
}

}  // namespace

void write_many(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                const std::vector<std::string>& packs) {
  const int64_t jobs = static_cast<int64_t>(srcs.size());
  TORCH_CHECK(dsts.size() == srcs.size() && packs.size() == srcs.size(),
              "write_many: as many destinations and packs as sources");
  std::vector<Kind> kinds(jobs);
  // every job checked before any byte is written
  for (int64_t j = 0; j < jobs; ++j) {
    const at::Tensor &s = srcs[j], &d = dsts[j];
    kinds[j] = kind_of(packs[j]);
    TORCH_CHECK(s.device().is_cpu() && d.device().is_cpu() && d.is_contiguous() &&
                    (s.scalar_type() == d.scalar_type() || casts(s, d)),
                "write_many: CPU tensors of one dtype, or float32 into bfloat16 (job ", j, ")");
    if (kinds[j] == kCopy) {
      TORCH_CHECK(s.is_contiguous() && s.numel() == d.numel(),
                  "write_many: a copy's source is contiguous and holds as many elements as its destination");
      continue;
    }
    TORCH_CHECK(s.dim() == 2 && (s.stride(1) == 1 || s.size(1) <= 1) && s.stride(0) >= s.size(1),
                "write_many: a pack's source is (N, K), its rows contiguous (job ", j, ")");
    const int64_t N = s.size(0), K = s.size(1), NP = (N + kPanel - 1) / kPanel;
    const bool f32 = kinds[j] == kF32;
    TORCH_CHECK(d.scalar_type() == (f32 ? at::kFloat : at::kBFloat16), "write_many: ", packs[j], " packs ",
                f32 ? "float32" : "bfloat16");
    const auto want = kinds[j] == kVnni ? std::vector<int64_t>{NP, (K + 1) / 2, kPanel, 2}
                                        : std::vector<int64_t>{NP, K, kPanel};
    TORCH_CHECK(d.sizes() == at::IntArrayRef(want), "write_many: ", packs[j], " of (", N, ", ", K,
                ") writes ", at::IntArrayRef(want));
    TORCH_CHECK(kinds[j] != kBf16Panel || rollout_f32::f32_panel_supported(),
                "write_many: bf16_panel_pack needs AVX-512 or AVX2 + FMA");
  }
  std::vector<Unit> units;
  std::vector<int64_t> start{0};  // bytes before each unit
  for (int64_t j = 0; j < jobs; ++j) {
    const at::Tensor& s = srcs[j];
    if (kinds[j] == kCopy && casts(s, dsts[j])) {  // in elements, weighed by the bytes read
      const int64_t n = s.numel(), step = kChunk / 4;
      for (int64_t e = 0; e < n; e += step) {
        units.push_back({j, e, std::min(n, e + step)});
        start.push_back(start.back() + 4 * (units.back().end - e));
      }
    } else if (kinds[j] == kCopy) {
      const int64_t n = s.nbytes();
      for (int64_t b = 0; b < n; b += kChunk) {
        units.push_back({j, b, std::min(n, b + kChunk)});
        start.push_back(start.back() + units.back().end - b);
      }
    } else {
      const int64_t NP = (s.size(0) + kPanel - 1) / kPanel, panel_bytes = kPanel * s.size(1) * s.element_size();
      for (int64_t p = 0; p < NP; ++p) {
        units.push_back({j, p, p + 1});
        start.push_back(start.back() + panel_bytes);
      }
    }
  }
  if (units.empty()) return;
  const int64_t total = start.back(), threads = std::max<int64_t>(1, at::get_num_threads());
  // thread t takes the units that start in its share of the bytes, [total * t / threads, total * (t + 1) / threads)
  auto first_unit_from = [&](int64_t t) -> int64_t {
    if (t == threads) return static_cast<int64_t>(units.size());
    return std::lower_bound(start.begin(), start.end() - 1, total * t / threads) - start.begin();
  };
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t u = first_unit_from(t0), last = first_unit_from(t1); u < last; ++u) {
      Unit x = units[u];
      if (kinds[x.job] != kCopy)  // a pack's panels in one call (it reads ahead into the next panel)
        for (; u + 1 < last && units[u + 1].job == x.job; ++u) x.end = units[u + 1].end;
      const at::Tensor &s = srcs[x.job], &d = dsts[x.job];
      if (casts(s, d)) {
        uint16_t* out = reinterpret_cast<uint16_t*>(d.data_ptr<c10::BFloat16>());
        if (kinds[x.job] == kCopy) {
          cast_bf16(s.data_ptr<float>() + x.begin, out + x.begin, x.end - x.begin, true);
          continue;
        }
        const int64_t N = s.size(0), K = s.size(1), ld = s.stride(0);
        if (kinds[x.job] == kVnni) {  // (cast in the pack's registers)
          rollout_vnni::vnni_pack_panels(s.data_ptr<float>(), out, N, K, ld, x.begin, x.end);
        } else {
          rollout_f32::bf16_pack_panels(s.data_ptr<float>(), out, N, K, ld, x.begin, x.end);
        }
        continue;
      }
      switch (kinds[x.job]) {
        case kCopy:
          stream_copy(static_cast<char*>(d.data_ptr()) + x.begin, static_cast<const char*>(s.data_ptr()) + x.begin,
                      x.end - x.begin);
          break;
        case kF32:
          rollout_f32::f32_pack_panels(s.data_ptr<float>(), d.data_ptr<float>(), s.size(0), s.size(1), s.stride(0),
                                       x.begin, x.end);
          break;
        case kVnni:
          rollout_vnni::vnni_pack_panels(reinterpret_cast<const uint16_t*>(s.data_ptr<c10::BFloat16>()),
                                         reinterpret_cast<uint16_t*>(d.data_ptr<c10::BFloat16>()), s.size(0),
                                         s.size(1), s.stride(0), x.begin, x.end);
          break;
        case kBf16Panel:
          rollout_f32::bf16_pack_panels(reinterpret_cast<const uint16_t*>(s.data_ptr<c10::BFloat16>()),
                                        reinterpret_cast<uint16_t*>(d.data_ptr<c10::BFloat16>()), s.size(0),
                                        s.size(1), s.stride(0), x.begin, x.end);
          break;
      }
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_sfence();  // the streamed stores are visible before the call returns
#endif
  });
}

}  // namespace rollout_spare
