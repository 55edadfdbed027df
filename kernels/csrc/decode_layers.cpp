// A decode step's decoder layers in one call (engine/model/decoder.py's DecodePlan). At small
// batches the layers' own work is a few tens of microseconds per op, and the Python between the
// ops (the interpreter, each op's argument parsing, the views) costs as much again; here the
// same ops run in the same order on the same tensors, so the result is the Python loop's bit for
// bit. The plan holds references to the model's tensors: in-place writes and storage swaps
// (`set_`) show through, a repack that replaces a packed tensor makes a new plan (the model's
// job).
#include <ATen/ATen.h>

#include <stdexcept>

#include "ops.h"

namespace rollout_layers {

namespace {

// at::Tensor x (M, K) @ weight.T + bias through the kernel that reads `l.panels`
at::Tensor run_linear(const DecodePlan::Linear& l, const at::Tensor& x) {
  switch (l.kind) {
    case DecodePlan::kVnni: return rollout_vnni::bf16_vnni_linear(x, l.panels, l.n, l.bias);
    case DecodePlan::kAmx: return rollout_amx::bf16_amx_linear(x, l.panels, l.n, l.bias);
    case DecodePlan::kF32Panels: return rollout_f32::f32_panel_linear(x, l.panels, l.n, l.bias);
    case DecodePlan::kBf16Panels: return rollout_f32::bf16_panel_linear(x, l.panels, l.n, l.bias);
  }
  throw std::invalid_argument("DecodePlan: unknown linear kind");
}

}  // namespace

DecodePlan::DecodePlan(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
                       double scale, int64_t sliding_window, at::Tensor cos_sin, at::Tensor final_norm)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
      scale_(scale), window_(sliding_window), cos_sin_(std::move(cos_sin)),
      final_norm_(std::move(final_norm)) {}

void DecodePlan::add_layer(const std::vector<std::optional<at::Tensor>>& norms,
                           const std::vector<std::tuple<at::Tensor, int64_t, std::optional<at::Tensor>, int64_t>>& linears,
                           at::Tensor k_cache, at::Tensor v_cache) {
  if (norms.size() != 4 || !norms[0] || !norms[3])
    throw std::invalid_argument("DecodePlan.add_layer: norms are [input, q or None, k or None, post]");
  if (linears.size() != 4) throw std::invalid_argument("DecodePlan.add_layer: linears are [qkv, o, gate_up, down]");
  Layer layer;
  layer.input_norm = *norms[0];
  layer.q_norm = norms[1];
  layer.k_norm = norms[2];
  layer.post_norm = *norms[3];
  Linear* dst[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
  for (int i = 0; i < 4; ++i) {
    const auto& [panels, n, bias, kind] = linears[i];
    if (kind < kVnni || kind > kBf16Panels) throw std::invalid_argument("DecodePlan.add_layer: unknown linear kind");
    *dst[i] = Linear{panels, n, bias, static_cast<Kind>(kind)};
  }
  layer.k_cache = std::move(k_cache);
  layer.v_cache = std::move(v_cache);
  layers_.push_back(std::move(layer));
}

at::Tensor DecodePlan::run(const at::Tensor& h_in, const at::Tensor& positions, const at::Tensor& slot_mapping,
                           const at::Tensor& block_table, const at::Tensor& seq_lens) const {
  const int64_t T = h_in.size(0), q_size = num_heads_ * head_dim_;
  at::Tensor h = h_in;
  std::optional<at::Tensor> residual;
  for (const Layer& layer : layers_) {
    auto [x, res] = rollout_fused::fused_add_rms_norm(h, residual, layer.input_norm, eps_);
    residual = std::move(res);
    at::Tensor qkv = run_linear(layer.qkv, x);
    auto q = std::get<0>(rollout_fused::rope_and_cache(qkv, positions, cos_sin_, layer.k_cache, layer.v_cache,
                                                       slot_mapping, num_heads_, num_kv_heads_, head_dim_,
                                                       layer.q_norm, layer.k_norm, eps_));
    at::Tensor a = paged_decode_attention(q, layer.k_cache, layer.v_cache, block_table, seq_lens, scale_, window_)
                       .view({T, q_size});
    h = run_linear(layer.o, a);
    std::tie(x, res) = rollout_fused::fused_add_rms_norm(h, residual, layer.post_norm, eps_);
    residual = std::move(res);
    h = run_linear(layer.down, rollout_fused::silu_and_mul(run_linear(layer.gate_up, x)));
  }
  return std::get<0>(rollout_fused::fused_add_rms_norm(h, residual, final_norm_, eps_));
}

}  // namespace rollout_layers
