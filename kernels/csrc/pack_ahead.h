// The pack functions (vnni_linear.cpp, f32_linear.cpp) read a panel's 32 source rows side by side,
// 16 or 8 at a time: more streams than the hardware prefetchers follow, so each panel's loads
// waited on memory and a bf16 pack took nearly twice a copy of the same bytes. While one panel is
// packed, PanelAhead reads the next one's rows into the cache a slice per step of the pack, and
// the next panel's pack finds them there (benchmarks/kernels_matmul.py prints the pack beside a
// copy). A panel's rows are contiguous, or ld apart (a tensor-parallel rank's column slice).
#pragma once

#include <algorithm>
#include <cstdint>

namespace rollout_pack {

class PanelAhead {
 public:
  // Panel p's successor of a pack of panels [p, p1) of src (N rows of K elements of `elem` bytes,
  // row i at src + i * ld elements; panels of 32 rows): none past p1 (another caller's), spread
  // over `steps` calls of step().
  PanelAhead(const void* src, int64_t elem, int64_t N, int64_t K, int64_t ld, int64_t p, int64_t p1, int64_t steps)
      : base_(static_cast<const char*>(src) + (p + 1) * 32 * ld * elem),
        ld_(ld * elem),
        row_lines_((K * elem + 63) / 64),
        lines_(p + 1 < p1 ? std::min<int64_t>(32, N - (p + 1) * 32) * row_lines_ : 0),
        per_step_(steps > 0 ? (lines_ + steps - 1) / steps : lines_) {}

  void step() {
    for (const int64_t end = std::min(lines_, line_ + per_step_); line_ < end; ++line_)
      __builtin_prefetch(base_ + (line_ / row_lines_) * ld_ + (line_ % row_lines_) * 64, 0, 1);
  }

 private:
  const char* base_;
  int64_t ld_, row_lines_, lines_, per_step_, line_ = 0;
};

}  // namespace rollout_pack
