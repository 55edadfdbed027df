// The extension module's Python bindings: every op declared in ops.h, one PYBIND11_MODULE.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using namespace rollout_fused;
  // The compute ops touch no Python object: they release the GIL while they run, so that the
  // core's other threads (IO, the scheduler beside a step in flight) run meanwhile, as they do
  // beside torch's own ops.
  using release_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention,
        "Paged-attention decode (CPU); sliding_window <= 0 means no window",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0, release_gil());
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Causal attention of many query tokens per sequence over the paged cache (CPU): q (T, H, D) "
        "rows of B sequences (cu_q_lens (B + 1,)), each sequence's last q_len of seq_lens cached tokens",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("cu_q_lens"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0,
        release_gil());
  m.def("fused_add_rms_norm", &fused_add_rms_norm,
        "(x (T, H), residual (T, H) or None, weight (H,), eps) -> (normed, new_residual); "
        "new_residual = residual + x (x itself when residual is None)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"), release_gil());
  m.def("rms_norm", &rms_norm, "HF LlamaRMSNorm over the last dim of a 1-3 dim tensor",
        py::arg("x"), py::arg("weight"), py::arg("eps"), release_gil());
  m.def("silu_and_mul", &silu_and_mul, "(T, 2I) -> silu(gate) * up, (T, I)",
        py::arg("gate_up"), release_gil());
  m.def("rope_and_cache", &rope_and_cache,
        "Rotary embedding of q and k from a fused qkv row (optionally per-head RMSNorm first), "
        "writes k and v into the paged cache; returns contiguous (q, k)",
        py::arg("qkv"), py::arg("positions"), py::arg("cos_sin"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("slot_mapping"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("q_norm") = py::none(),
        py::arg("k_norm") = py::none(), py::arg("eps") = 1e-6, release_gil());
  m.def("rope_and_cache_qk", &rope_and_cache_qk,
        "rope_and_cache with separate (possibly strided) q, k, v views",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("positions"), py::arg("cos_sin"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"), release_gil());
  m.def("greedy_logprobs", &greedy_logprobs,
        "(logits (N, V)) -> (first argmax per row (N,) int64, its log-softmax (N,) float32; "
        "left unset unless with_logprobs)",
        py::arg("logits"), py::arg("with_logprobs") = true, release_gil());
  m.def("logsumexp_rows", &logsumexp_rows,
        "(x (N, V)) -> (N,) float32 logsumexp of each row, one fixed order per row "
        "(batch-invariant)", py::arg("x"), release_gil());
  m.def("sample_rows", &sample_rows,
        "(logits (N, V), temperature (N,), u (N,) in [0, 1), with_logprobs) -> (ids (N,) int64, "
        "logprobs (N,) float32): the token at u of softmax(logits / temperature) by inverse CDF, and its "
        "logprob; no top-k/top-p/min-p", py::arg("logits"), py::arg("temperature"), py::arg("u"),
        py::arg("with_logprobs") = false, release_gil());
  m.def("invariant_linear", &rollout_invariant::invariant_linear,
        "x (M, K) @ weight (N, K).T + bias, float32; each output one fixed-order dot product "
        "(batch-invariant)", py::arg("x"), py::arg("weight"), py::arg("bias") = py::none(),
        release_gil());
  m.def("bf16_vnni_supported", &rollout_vnni::bf16_vnni_supported,
        "whether bf16_vnni_linear is built for this CPU (AVX-512 BF16)");
  m.def("bf16_vnni_pack", &rollout_vnni::bf16_vnni_pack,
        "weight (N, K) bf16 -> (ceil(N/32), ceil(K/2), 32, 2): the layout bf16_vnni_linear reads "
        "(written into `out` when given)",
        py::arg("weight"), py::arg("out") = py::none(), release_gil());
  m.def("bf16_vnni_linear", &rollout_vnni::bf16_vnni_linear,
        "x (M, K) @ weight.T + bias in bfloat16 (float32 sums) from bf16_vnni_pack(weight): for "
        "decode steps", py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        release_gil());
  m.def("bf16_amx_supported", &rollout_amx::bf16_amx_supported,
        "whether bf16_amx_linear is built for this CPU (AMX) and this process may use AMX tiles");
  m.def("bf16_amx_linear", &rollout_amx::bf16_amx_linear,
        "x (M, K) @ weight.T + bias in bfloat16 (float32 sums) on AMX tiles, from bf16_vnni_pack(weight); "
        "K % 32 == 0", py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        release_gil());
  m.def("f32_panel_supported", &rollout_f32::f32_panel_supported,
        "whether f32_panel_linear and bf16_panel_linear are built for this CPU (AVX-512 or AVX2 + FMA)");
  m.def("f32_panel_pack", &rollout_f32::f32_panel_pack,
        "weight (N, K) float32 -> (ceil(N/32), K, 32): the layout f32_panel_linear reads (written into `out` "
        "when given)", py::arg("weight"), py::arg("out") = py::none(), release_gil());
  m.def("f32_panel_linear", &rollout_f32::f32_panel_linear,
        "x (M, K) @ weight.T + bias in float32 from f32_panel_pack(weight); each output one FMA chain in k "
        "order", py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        release_gil());
  m.def("bf16_panel_pack", &rollout_f32::bf16_panel_pack,
        "weight (N, K) bfloat16 -> (ceil(N/32), K, 32) bfloat16: the layout bf16_panel_linear reads (written "
        "into `out` when given; where f32_panel_supported)", py::arg("weight"), py::arg("out") = py::none(),
        release_gil());
  m.def("bf16_panel_linear", &rollout_f32::bf16_panel_linear,
        "x (M, K) @ weight.T + bias in bfloat16 from bf16_panel_pack(weight): float32 FMA chains in k order, "
        "rounded once", py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias") = py::none(),
        release_gil());
  m.def("write_many", &rollout_spare::write_many,
        "srcs[i] into dsts[i] for every i: packed by packs[i] (f32_panel_pack, bf16_vnni_pack, bf16_panel_pack) "
        "into a destination of its packed shape, or copied (\"\": as many elements, both contiguous); a float32 "
        "source of a bfloat16 destination cast on the way, as torch rounds; all in one parallel region, stores "
        "streamed past the cache (a trainer's write into a leased weight spare)",
        py::arg("srcs"), py::arg("dsts"), py::arg("packs"), release_gil());
  m.def("fused_experts", &rollout_moe::fused_experts,
        "x (T, H), w13 (E, 2I, H), w2 (E, H, I), topk_ids (T, k), topk_weights (T, k) -> (T, H): each "
        "token's experts' SwiGLU MLPs, weighted and summed in ascending expert id (ids outside [0, E) "
        "add nothing); float32 or bfloat16 (see kernels/moe.py)",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("topk_ids"), py::arg("topk_weights"),
        release_gil());
  using rollout_layers::DecodePlan;
  py::class_<DecodePlan>(m, "DecodePlan",
                         "A decode step's dense decoder layers in one call (engine/model/decoder.py)")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, at::Tensor, at::Tensor>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"),
           py::arg("sliding_window"), py::arg("cos_sin"), py::arg("final_norm"))
      .def("add_layer", &DecodePlan::add_layer,
           "norms [input, q_norm or None, k_norm or None, post]; linears [(panels, n, bias or None, kind)] of "
           "qkv, o, gate_up, down (kind: 0 bf16_vnni_linear, 1 bf16_amx_linear, 2 f32_panel_linear, "
           "3 bf16_panel_linear)", py::arg("norms"), py::arg("linears"), py::arg("k_cache"), py::arg("v_cache"))
      .def("run", &DecodePlan::run, "h (T, H) of an all-decode step -> the final-normed hidden states",
           py::arg("h"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_table"),
           py::arg("seq_lens"), release_gil());
  // The GIL is released while a call waits for its peers: they may be threads of this process.
  using rollout_shm::ShmComm;
  py::class_<ShmComm>(m, "ShmComm",
                      "Collectives over a /dev/shm segment shared by the ranks of one machine "
                      "(see kernels/shm_comm.py)")
      .def(py::init([](const std::string& name, int64_t rank, int64_t world_size, int64_t slot_bytes,
                       double timeout_s) {
             py::gil_scoped_release release;
             return std::make_unique<ShmComm>(name, rank, world_size, slot_bytes, timeout_s);
           }),
           py::arg("name"), py::arg("rank"), py::arg("world_size"), py::arg("slot_bytes"),
           py::arg("timeout_s"))
      .def("all_reduce_", &ShmComm::all_reduce_, "in-place sum over the ranks", py::arg("t"),
           release_gil())
      .def("all_gather", &ShmComm::all_gather, "the ranks' tensors concatenated along dim 0",
           py::arg("t"), release_gil())
      .def("gather", &ShmComm::gather, "all_gather on dst; None on the other ranks", py::arg("t"),
           py::arg("dst"), release_gil())
      .def("barrier", &ShmComm::barrier, release_gil())
      .def("close", &ShmComm::close)
      .def_property_readonly("segment_name", &ShmComm::segment_name);
}
