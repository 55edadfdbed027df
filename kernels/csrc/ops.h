// The C++ CPU ops of the extension module, declared once: defined in paged_attention.cpp,
// fused_ops.cpp, decode_layers.cpp, invariant_ops.cpp, vnni_linear.cpp, amx_linear.cpp,
// f32_linear.cpp, spare_write.cpp, moe.cpp and shm_comm.cpp, bound to Python in bindings.cpp
// (the module's only PYBIND11_MODULE).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

// paged_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& seq_lens, double scale,
                                  int64_t sliding_window);
at::Tensor paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   const at::Tensor& cu_q_lens, const at::Tensor& seq_lens,
                                   double scale, int64_t sliding_window);

// fused_ops.cpp
namespace rollout_fused {
std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm(const at::Tensor& x,
                                                      const std::optional<at::Tensor>& residual,
                                                      const at::Tensor& weight, double eps);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
std::tuple<at::Tensor, at::Tensor> rope_and_cache(
    const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slot_mapping,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    double eps);
std::tuple<at::Tensor, at::Tensor> rope_and_cache_qk(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& positions,
    const at::Tensor& cos_sin, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& slot_mapping);
std::tuple<at::Tensor, at::Tensor> greedy_logprobs(const at::Tensor& logits, bool with_logprobs);
at::Tensor logsumexp_rows(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor> sample_rows(const at::Tensor& logits, const at::Tensor& temperature,
                                               const at::Tensor& u, bool with_logprobs);
}  // namespace rollout_fused

// invariant_ops.cpp
namespace rollout_invariant {
at::Tensor invariant_linear(const at::Tensor& x, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias);
}  // namespace rollout_invariant

// vnni_linear.cpp
namespace rollout_vnni {
bool bf16_vnni_supported();
at::Tensor bf16_vnni_pack(const at::Tensor& weight, const std::optional<at::Tensor>& out);
// panels [p0, p1) of bf16_vnni_pack's layout of src (N, K; row i at src + i * ld) into dst (the
// whole packed tensor)
void vnni_pack_panels(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1);
// the same of a float32 src, each value rounded to bf16 as torch's cast rounds (a trainer's master weights)
void vnni_pack_panels(const float* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1);
at::Tensor bf16_vnni_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const std::optional<at::Tensor>& bias);
}  // namespace rollout_vnni

// amx_linear.cpp
namespace rollout_amx {
bool bf16_amx_supported();
at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const std::optional<at::Tensor>& bias);
}  // namespace rollout_amx

// f32_linear.cpp
namespace rollout_f32 {
bool f32_panel_supported();
at::Tensor f32_panel_pack(const at::Tensor& weight, const std::optional<at::Tensor>& out);
at::Tensor f32_panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                            const std::optional<at::Tensor>& bias);
at::Tensor bf16_panel_pack(const at::Tensor& weight, const std::optional<at::Tensor>& out);
// panels [p0, p1) of f32_panel_pack's / bf16_panel_pack's layout of src (N, K; row i at src + i * ld)
// into dst (the whole packed tensor)
void f32_pack_panels(const float* src, float* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1);
void bf16_pack_panels(const uint16_t* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1);
// the same of a float32 src, each value rounded to bf16 as torch's cast rounds (a trainer's master weights)
void bf16_pack_panels(const float* src, uint16_t* dst, int64_t N, int64_t K, int64_t ld, int64_t p0, int64_t p1);
at::Tensor bf16_panel_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                             const std::optional<at::Tensor>& bias);
}  // namespace rollout_f32

// spare_write.cpp
namespace rollout_spare {
void write_many(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts,
                const std::vector<std::string>& packs);
}  // namespace rollout_spare

// moe.cpp
namespace rollout_moe {
at::Tensor fused_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                         const at::Tensor& topk_ids, const at::Tensor& topk_weights);
}  // namespace rollout_moe

// decode_layers.cpp: a decode step's dense decoder layers in one call, the same ops in the same
// order as engine/model/decoder.py's loop (bit for bit). Holds references to the model's tensors.
namespace rollout_layers {
class DecodePlan {
 public:
  enum Kind : int64_t { kVnni = 0, kAmx = 1, kF32Panels = 2, kBf16Panels = 3 };  // which kernel reads a panel
  struct Linear {
    at::Tensor panels;
    int64_t n;
    std::optional<at::Tensor> bias;
    Kind kind;
  };
  DecodePlan(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
             int64_t sliding_window, at::Tensor cos_sin, at::Tensor final_norm);
  // norms: [input, q_norm or None, k_norm or None, post]; linears: (panels, N, bias, kind) of
  // [qkv, o, gate_up, down]
  void add_layer(const std::vector<std::optional<at::Tensor>>& norms,
                 const std::vector<std::tuple<at::Tensor, int64_t, std::optional<at::Tensor>, int64_t>>& linears,
                 at::Tensor k_cache, at::Tensor v_cache);
  // h (T, H): the embedded tokens of an all-decode step -> the final-normed hidden states (T, H)
  at::Tensor run(const at::Tensor& h, const at::Tensor& positions, const at::Tensor& slot_mapping,
                 const at::Tensor& block_table, const at::Tensor& seq_lens) const;

 private:
  struct Layer {
    at::Tensor input_norm, post_norm;
    std::optional<at::Tensor> q_norm, k_norm;
    Linear qkv, o, gate_up, down;
    at::Tensor k_cache, v_cache;
  };
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t window_;
  at::Tensor cos_sin_, final_norm_;
  std::vector<Layer> layers_;
};
}  // namespace rollout_layers

// shm_comm.cpp: collectives over one /dev/shm segment shared by the ranks of one machine
// (kernels/shm_comm.py states the contract). Not thread-safe: one caller thread per object.
namespace rollout_shm {
class ShmComm {
 public:
  // Creates (rank 0) or attaches to (other ranks, waiting for rank 0) the segment of `name`,
  // then waits until all world_size ranks have joined.
  ShmComm(const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
          double timeout_s);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  void all_reduce_(const at::Tensor& t);  // in-place sum, rank order 0..N-1, float32 sums
  at::Tensor all_gather(const at::Tensor& t);  // ranks' tensors concatenated along dim 0
  std::optional<at::Tensor> gather(const at::Tensor& t, int64_t dst);  // the same, on dst only
  void barrier();
  void close();  // idempotent; rank 0 or the last rank out unlinks the segment
  std::string segment_name() const;  // "/rollout-shm-<name>"

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};
}  // namespace rollout_shm
