"""The decoder of the Llama family (Llama, Mistral, Qwen2, Qwen3) in plain torch.

Weights live in plain tensors, projections fused: qkv = [q; k; v] rows, gate_up = [gate; up].
`hf_views()` maps every Hugging Face parameter name onto a view of these tensors, so loading,
weight pushes and checksums all speak HF names and write in place. On CPU the linear weights are
also kept packed for the matmul kernel that reads them (see Linear); `repack()` must run after
any write to the plain tensors.

The forward pass takes a flat batch of T tokens from many sequences (see engine/model/attention.py)
and avoids nn.Module: at this model size per-op overhead is the enemy.

With tensor parallelism (`tp`, engine/model/parallel.py) the model holds one rank's shard: its
heads, intermediate columns and vocabulary rows. HF names still name full tensors: a rank's view
of one is its slice (`hf_view`), `expected_weights` gives the full shapes a trainer sends, and
`shard_of` cuts a rank's slice out of a full tensor.
"""
import functools
from typing import Iterator

import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.errors import InvalidRequestError, UnsupportedModelError
from engine.model.attention import AttentionMetadata, attention
from engine.model.moe import EPGroup, MoE
from engine.model.parallel import Partition, Shard, TPGroup, gather_along
from engine.model.vision import VisionEncoder
from kernels import cpu_ext
from kernels.activation import silu_and_mul
from kernels.norm import fused_add_rms_norm
from kernels.rotary import rope_and_cache, rope_cos_sin_cache, rope_inv_freq
from weight_sync.checkpoint import load_safetensors_folder
from weight_sync.names import expert_names, router_name, split_experts

# Where our own packed copy of a weight serves every step (`Linear.panels`): float32 on CPUs with
# AVX-512 or AVX2 + FMA (kernels/csrc/f32_linear.cpp: on a 2-core Xeon 1.4-1.5x oneDNN's prepacked
# GEMM at 8-32 rows, even with it at 128-512; on an AVX2 EPYC 1.0x oneDNN at 1 row, 1.2-1.45x at
# 4-32, 1.1x at 128-2048), bf16 on CPUs with
# AVX-512 BF16 (kernels/csrc/vnni_linear.cpp: on an EPYC 2x oneDNN at 1-8 rows, 1.3x at 16, even
# at 512) and, where AMX exists, the same bf16 panels through kernels/csrc/amx_linear.cpp (on a
# 2-core Xeon as fast as vnni_linear at 1-2 rows, 1.5-4x it from 8 rows on; 1.5-2x oneDNN's AMX
# GEMM up to 32 rows, even with it at 64-256, 0.9x at prefill's 1024-4096); bf16 on the other
# CPUs with AVX-512 or AVX2 + FMA, as float32 panels of bf16 weights (f32_linear.cpp's
# bf16_panel_linear: float32 FMAs on weights widened in registers; on an AVX2 EPYC, where oneDNN
# has no bf16 linear, 1.6x F.linear at 1 row, 6-8x from 8 rows on). Ours are packed in
# place by a weight update; oneDNN's copy can only be made in fresh memory, whose page faults
# made its reorder most of a float32 update (~0.25 s of the default model's). Elsewhere oneDNN's
# prepacked GEMM takes every step.
#
# bf16 with AMX but without the AMX kernel (K not a multiple of 32; an OS that refuses the tile
# state): vnni_linear's dot products ran at ~75 GFLOP/s on that Xeon and oneDNN's AMX GEMM matched
# them at 8 rows, so it takes the steps of more rows.
BF16_VNNI_MAX_ROWS_WITH_AMX = 8
EVERY_STEP = 1 << 62  # a panel_max that no step reaches


def f32_panels_serve(ext, dtype: torch.dtype) -> bool:
    """Whether linears of this dtype run on the float32 panels (f32_linear.cpp; `ext`: the C++
    kernels or None): float32, and bf16 where AVX-512 BF16's own kernel does not take it."""
    return (ext is not None and dtype in (torch.float32, torch.bfloat16) and ext.f32_panel_supported()
            and not (dtype == torch.bfloat16 and ext.bf16_vnni_supported()))


class Linear:
    """y = x @ weight.T (+ bias) through, in this order of preference: our kernel on our packed
    copy (`panels`, steps of <= panel_max rows); a oneDNN-prepacked copy (`packed`); the
    fixed-order kernel on the plain weight (batch-invariant mode on a CPU without the panels);
    F.linear. `weight` stays the plain tensor that loads, pushes and checksums read and write
    (`pack()` after a write); where the panels alone serve every step a trainer may write them
    instead, and `unpack()` brings `weight` up to date (LlamaModel.panels_written)."""

    __slots__ = ("weight", "bias", "panels", "panel_linear", "panel_max", "pack_fn", "packed", "invariant")

    def __init__(self, out_features: int, in_features: int, bias: bool, dtype, device):
        self.weight = torch.zeros(out_features, in_features, dtype=dtype, device=device)
        self.bias = torch.zeros(out_features, dtype=dtype, device=device) if bias else None
        self.panels = self.panel_linear = None  # our packed copy and the kernel reading it: (x, panels, N, bias)
        self.panel_max = 0
        self.pack_fn = None  # the name of the kernels' function that made `panels` (their layout)
        self.packed = None
        self.invariant = None  # kernels' invariant_linear(x, weight, bias) in batch-invariant mode

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.shape[0] <= self.panel_max:
            return self.panel_linear(x, self.panels, self.weight.shape[0], self.bias)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.invariant is not None:
            return self.invariant(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def pack(self, ext, onednn: bool) -> None:
        """Refresh the packed copies from `weight` (ext: the C++ kernels or None; onednn: whether
        oneDNN's prepacked linear works here in this dtype). Packs nothing when neither applies.
        Our own packed copy is rewritten in place when its shape holds (a weight update runs with
        no step in flight): fresh memory would cost page faults worth several copies."""
        old, self.panels = self.panels, None
        self.panel_linear = self.packed = self.pack_fn = None
        self.panel_max = 0
        dtype, (n, k) = self.weight.dtype, self.weight.shape
        if ext is not None and dtype == torch.bfloat16 and ext.bf16_vnni_supported():
            shape = ((n + 31) // 32, (k + 1) // 2, 32, 2)  # panels of 32 columns, k in pairs
            self.pack_fn = "bf16_vnni_pack"
            self.panels = ext.bf16_vnni_pack(self.weight, old if old is not None and old.shape == shape else None)
            amx = ext.bf16_amx_supported() and k % 32 == 0
            self.panel_linear = ext.bf16_amx_linear if amx else ext.bf16_vnni_linear
            self.panel_max = EVERY_STEP if amx or not cpu_ext.cpu_has("amx_bf16") else BF16_VNNI_MAX_ROWS_WITH_AMX
        elif f32_panels_serve(ext, dtype):
            shape = ((n + 31) // 32, k, 32)  # panels of 32 columns, k-major
            self.pack_fn, self.panel_linear = (("f32_panel_pack", ext.f32_panel_linear) if dtype == torch.float32
                                               else ("bf16_panel_pack", ext.bf16_panel_linear))
            reuse = old if old is not None and old.shape == shape else None
            self.panels = getattr(ext, self.pack_fn)(self.weight, reuse)
            self.panel_max = EVERY_STEP
        if self.panel_max == EVERY_STEP:
            return
        if onednn:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, 32)

    def panels_serve(self) -> bool:
        """Whether every step reads the panels alone (`weight` then only serves reads of the weights)."""
        return self.panels is not None and self.panel_max == EVERY_STEP and self.packed is None

    def unpack(self) -> None:
        """Write `weight` back from the panels."""
        self.weight.copy_(self.plain_of(self.panels, self.weight.shape[0]))

    def plain_of(self, panels: torch.Tensor, n: int) -> torch.Tensor:
        """The `n` rows that `panels` (in this linear's layout: 32 rows a panel, k-major, in pairs
        or not) hold, as a plain (n, k) tensor."""
        k, p = self.weight.shape[1], panels
        if self.pack_fn == "bf16_vnni_pack":  # (n / 32, k / 2, 32, 2)
            plain = p.permute(0, 2, 1, 3).reshape(p.shape[0] * 32, p.shape[1] * 2)
        else:  # f32_panel_pack, bf16_panel_pack: (n / 32, k, 32)
            rows = p.permute(0, 2, 1)
            if self.pack_fn == "bf16_panel_pack":  # a panel's rows interleaved for the kernel's widening loads
                rows = rows[:, _bf16_panel_order()]
            plain = rows.reshape(p.shape[0] * 32, k)
        return plain[:n, :k]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of `weight` read from the panels (what `unpack` would write there): a tied
        embedding whose panels alone were pushed."""
        p, k = self.panels, self.weight.shape[1]
        at = ids % 32
        if self.pack_fn == "bf16_panel_pack":
            at = _bf16_panel_order().to(ids.device)[at]
        if self.pack_fn == "bf16_vnni_pack":  # (n / 32, k / 2, 32, 2)
            return p[ids // 32, :, at, :].reshape(ids.shape[0], -1)[:, :k]
        return p[ids // 32, :, at]


@functools.cache
def _bf16_panel_order() -> torch.Tensor:
    """For each of a panel's 32 rows, where bf16_panel_pack puts it (its order depends on the
    build's vector width): read off the kernel itself."""
    where = cpu_ext.load().bf16_panel_pack(torch.arange(32, dtype=torch.bfloat16).view(32, 1), None)[0, 0]
    return torch.argsort(where.long())


class Layer:
    # a mixture-of-experts layer has `moe` (engine/model/moe.py) where a dense one has gate_up and down
    __slots__ = ("input_norm", "qkv", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "moe")


class LayerOps:
    """The small per-layer ops, chosen once per model by kernels.cpu_ext's rules: the C++
    functions themselves when they take this model's tensors (our own ops' outputs are
    contiguous), else the checking wrappers (any device). In a decode step every call comes right
    after a matmul has flushed the caches, and skipping the wrappers' checks saves ~5-10 us a call."""

    __slots__ = ("add_norm", "rope_and_cache", "silu_and_mul", "decode_attention", "ext")

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int):
        ext = cpu_ext.ops_for(device, dtype)
        fused = ext is not None and cpu_ext.supports_head_dim("rotary", head_dim)
        self.add_norm = ext.fused_add_rms_norm if fused else fused_add_rms_norm
        self.rope_and_cache = ext.rope_and_cache if fused else rope_and_cache
        self.silu_and_mul = ext.silu_and_mul if fused else silu_and_mul
        # (q, k_cache, v_cache, block_table, seq_lens, scale, window) for an all-decode step, or None
        attention_ok = ext is not None and cpu_ext.supports_head_dim("attention", head_dim)
        self.decode_attention = ext.paged_decode_attention if attention_ok else None
        self.ext = ext if fused and attention_ok else None  # every op above is its kernel: a DecodePlan can run them


class LlamaModel:
    def __init__(self, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_len: int,
                 batch_invariant: bool = False, tp: TPGroup | None = None, ep: EPGroup | None = None):
        self.mc, self.dtype, self.device = mc, dtype, device
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.ep = ep if mc.moe is not None and ep is not None and ep.world_size > 1 else None
        if mc.moe is not None and (self.tp is not None or batch_invariant):
            raise UnsupportedModelError("a mixture-of-experts model runs with tensor_parallel_size 1 and without "
                                        "batch_invariant (expert parallelism across replicas: enable_expert_parallel)")
        size, rank = (tp.size, tp.rank) if self.tp else (1, 0)
        self.partitions = [Partition.of(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, mc.vocab_size, size, r)
                           for r in range(size)]
        self.part = part = self.partitions[rank]
        if self.tp is not None and mc.vision:
            raise UnsupportedModelError("tensor parallelism does not cover vision-language models yet: "
                                        "tensor_parallel_size must be 1")
        H, D, I = mc.hidden_size, mc.head_dim, part.intermediate[1]
        self.num_heads, self.num_kv_heads = part.q_heads[1], part.kv_heads[1]  # this rank's
        self.q_size, self.kv_size = self.num_heads * D, self.num_kv_heads * D
        self.scale = D ** -0.5

        def vec(n, fill=0.0):
            return torch.full((n,), fill, dtype=dtype, device=device)

        self.embed = torch.zeros(part.vocab[1], H, dtype=dtype, device=device)
        self.layers = []
        moe_layers = set(mc.moe.layers) if mc.moe is not None else set()
        for i in range(mc.num_layers):
            layer = Layer()
            layer.input_norm, layer.post_norm = vec(H), vec(H)
            layer.qkv = Linear(self.q_size + 2 * self.kv_size, H, mc.qkv_bias, dtype, device)
            layer.q_norm, layer.k_norm = (vec(D), vec(D)) if mc.qk_norm else (None, None)
            layer.o = Linear(H, self.q_size, False, dtype, device)
            if i in moe_layers:
                router = Linear(mc.moe.num_experts, H, False, dtype, device)
                layer.moe, layer.gate_up, layer.down = MoE(mc.moe, H, router, dtype, device, self.ep), None, None
            else:
                layer.moe = None
                layer.gate_up = Linear(2 * I, H, False, dtype, device)
                layer.down = Linear(H, I, False, dtype, device)
            self.layers.append(layer)
        # (num KV slots, num_layers, top_k) int16: each computed token's experts by layer, -1 in dense
        # layers (set by the runner when routed experts are returned; see ModelRunner.routed_experts)
        self.routing: torch.Tensor | None = None
        self.norm = vec(H)
        # a causal LM's vocabulary head, or a sequence classifier's label head (`score`)
        self.lm_head = None if mc.num_labels else Linear(part.vocab[1], H, False, dtype, device)
        self.score = Linear(mc.num_labels, H, False, dtype, device) if mc.num_labels else None
        if self.lm_head is not None and mc.tie_word_embeddings:
            self.lm_head.weight = self.embed
        slow_bf16 = dtype == torch.bfloat16 and device.type == "cpu" and not _mkldnn_ok(dtype)
        self.vision = (VisionEncoder(mc.vision, H, dtype, device, torch.float32 if slow_bf16 else None)
                       if mc.vision else None)
        inv_freq, attention_factor = rope_inv_freq(D, mc.rope_theta, mc.rope_scaling)
        self.cos_sin = rope_cos_sin_cache(inv_freq, attention_factor, max_len).to(device)  # (L, 2, D/2) fp32
        self.ops = LayerOps(device, dtype, D)
        self.batch_invariant = batch_invariant
        # An all-decode step's layers run in one C++ call (kernels/csrc/decode_layers.cpp) where the
        # model's every op is a C++ kernel: the same ops, in the same order, without the Python between
        # them (at batch 1 that Python cost about a tenth of a step). The plan is made on first use and
        # again after every repack and for every new KV cache. use_decode_plan = False (the engine's
        # enforce_eager) keeps the op-by-op loop below.
        self.use_decode_plan = True
        self.drop_decode_plan()
        # linears whose panels a trainer wrote (panels_written): their plain `weight` is brought up to
        # date when something reads it, so that a push costs one write of the panels
        self._behind: dict[int, Linear] = {}
        if batch_invariant:
            self._use_invariant_kernels()
        self._hf = self._hf_name_map()
        self._aliases = self._fused_expert_names()

    def _use_invariant_kernels(self) -> None:
        """Batch-invariant mode (see engine/model/batch_invariant.py): every projection sums each output
        in one fixed order, through the float32 panels (`repack`) or, on a CPU without them,
        `invariant_linear` on the plain weight (the same bits); the per-row C++ ops (norms, rotary,
        activation) and the paged attention kernel are invariant as they are, and the runner sends
        every token through the latter."""
        ext = cpu_ext.ops_for(self.device, self.dtype)
        if ext is None or self.dtype != torch.float32 or self.ops.decode_attention is None:
            raise UnsupportedModelError(
                "batch-invariant mode needs float32 on CPU, the C++ CPU kernels (a compiler; see the "
                "'kernels' log) and a head_dim that is a multiple of 16, at most 512")
        for lin in self._linears():
            lin.invariant = ext.invariant_linear

    def _linears(self) -> list[Linear]:
        heads = [h for h in (self.lm_head, self.score) if h is not None]
        per_layer = [(layer.qkv, layer.o, layer.gate_up, layer.down) if layer.moe is None
                     else (layer.qkv, layer.o, layer.moe.router) for layer in self.layers]
        return [lin for lins in per_layer for lin in lins] + heads

    # ---- weights, by Hugging Face names -------------------------------------------------
    def _hf_name_map(self) -> dict[str, tuple[torch.Tensor, int, int, Shard]]:
        """HF name -> (tensor, first row, number of rows) of the fused tensor it lives in, and which
        slice of the full HF tensor each rank holds."""
        q, kv, inter, pre = self.q_size, self.kv_size, self.part.intermediate[1], self.mc.text_prefix
        D, parts = self.mc.head_dim, self.partitions
        whole = Shard()
        if self.tp is None:
            by_q = by_kv = by_inter = by_vocab = whole
            col_q = col_inter = whole
        else:
            by_q = Shard(0, tuple((s * D, n * D) for s, n in (p.q_heads for p in parts)))
            by_kv = Shard(0, tuple((s * D, n * D) for s, n in (p.kv_heads for p in parts)))
            by_inter = Shard(0, tuple(p.intermediate for p in parts))
            by_vocab = Shard(0, tuple(p.vocab for p in parts))
            col_q, col_inter = Shard(1, by_q.ranges), Shard(1, by_inter.ranges)

        def full(t: torch.Tensor, shard: Shard = whole) -> tuple:
            return t, 0, t.shape[0], shard

        m = {pre + "embed_tokens.weight": full(self.embed, by_vocab), pre + "norm.weight": full(self.norm)}
        if self.vision is not None:
            m.update((name, full(t)) for name, t in self.vision.tensors.items())
        if self.score is not None:
            m["score.weight"] = full(self.score.weight)
        elif not self.mc.tie_word_embeddings:
            m["lm_head.weight"] = full(self.lm_head.weight, by_vocab)
        for i, layer in enumerate(self.layers):
            p = f"{pre}layers.{i}."
            m[p + "input_layernorm.weight"] = full(layer.input_norm)
            m[p + "post_attention_layernorm.weight"] = full(layer.post_norm)
            for name, start, rows, shard in (("q_proj", 0, q, by_q), ("k_proj", q, kv, by_kv),
                                             ("v_proj", q + kv, kv, by_kv)):
                m[p + f"self_attn.{name}.weight"] = (layer.qkv.weight, start, rows, shard)
                if layer.qkv.bias is not None:
                    m[p + f"self_attn.{name}.bias"] = (layer.qkv.bias, start, rows, shard)
            if layer.q_norm is not None:
                m[p + "self_attn.q_norm.weight"] = full(layer.q_norm)
                m[p + "self_attn.k_norm.weight"] = full(layer.k_norm)
            m[p + "self_attn.o_proj.weight"] = full(layer.o.weight, col_q)
            if layer.moe is not None:
                m.update(self._expert_names(p, layer.moe))
                continue
            m[p + "mlp.gate_proj.weight"] = (layer.gate_up.weight, 0, inter, by_inter)
            m[p + "mlp.up_proj.weight"] = (layer.gate_up.weight, inter, inter, by_inter)
            m[p + "mlp.down_proj.weight"] = full(layer.down.weight, col_inter)
        return m

    def _expert_names(self, p: str, moe: MoE) -> dict[str, tuple[torch.Tensor, int, int, Shard]]:
        """A MoE layer's checkpoint names: its router and every expert's gate, up and down (Mixtral:
        block_sparse_moe's w1, w3, w2). Under expert parallelism the experts of other replicas are
        empty slices here (nothing to receive, nothing to write), their full shapes kept for checks."""
        E, I, H, style = moe.cfg.num_experts, moe.cfg.intermediate_size, self.mc.hidden_size, moe.cfg.checkpoint_style
        m = {router_name(p, style): (moe.router.weight, 0, E, Shard())}
        none_h, none_i = moe.w13.new_empty(0, H), moe.w2.new_empty(0, I)
        for e in range(E):
            gate, up, down = expert_names(p, e, style)
            if moe.first <= e < moe.first + moe.count:
                w13, w2 = moe.w13[e - moe.first], moe.w2[e - moe.first]
                m[gate], m[up], m[down] = (w13, 0, I, Shard()), (w13, I, I, Shard()), (w2, 0, H, Shard())
            else:
                m[gate] = m[up] = (none_h, 0, 0, Shard(0, ((0, 0),), I))
                m[down] = (none_i, 0, 0, Shard(0, ((0, 0),), H))
        return m

    def _fused_expert_names(self) -> dict[str, tuple[torch.Tensor, int, int, Shard]]:
        """transformers' in-memory names for the same tensors (a trainer's state_dict(): the router
        as mlp.gate, every expert in one mlp.experts.gate_up_proj (E, 2I, H) and down_proj (E, H, I)),
        accepted by pushes and split into the checkpoint names (split_fused_experts)."""
        m = {}
        for i, layer in enumerate(self.layers):
            moe = layer.moe
            if moe is None:
                continue
            p = f"{self.mc.text_prefix}layers.{i}.mlp."
            ep = Shard(0, ((moe.first, moe.count),), moe.cfg.num_experts)
            if moe.cfg.checkpoint_style == "mixtral":
                m[p + "gate.weight"] = (moe.router.weight, 0, moe.cfg.num_experts, Shard())
            m[p + "experts.gate_up_proj"] = (moe.w13, 0, moe.count, ep)
            m[p + "experts.down_proj"] = (moe.w2, 0, moe.count, ep)
        return m

    def _entry(self, name: str) -> tuple[torch.Tensor, int, int, Shard]:
        entry = self._hf.get(name)
        return entry if entry is not None else self._aliases[name]

    def hf_view(self, name: str, current: bool = True) -> torch.Tensor:
        """The in-place view of one HF parameter (this rank's slice of it); KeyError for a name
        the model does not have. current=False: only its place and shape are wanted (the values
        of a linear whose panels were written may lag until they are read: panels_written)."""
        tensor, start, rows, _ = self._entry(name)
        if current and self._behind:
            self._catch_up()
        return tensor.narrow(0, start, rows)

    def hf_views(self, current: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF parameter's view: the full tensors, or with tensor parallelism this rank's
        slices (engine/worker/worker.py's full_weights gathers them)."""
        for name in self._hf:
            yield name, self.hf_view(name, current)

    def hf_shard(self, name: str) -> Shard:
        return self._entry(name)[3]

    def shard_of(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full HF tensor `name` (a view; the tensor itself without
        tensor parallelism). A tied model's pushed lm_head.weight is cut like the embedding."""
        if name == "lm_head.weight" and name not in self._hf:
            name = self.mc.text_prefix + "embed_tokens.weight"
        return self._entry(name)[3].of(full, self.part.rank)

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name -> (shape, dtype) of the full tensors a trainer pushes."""
        return {name: (self.hf_shard(name).full_shape(tuple(v.shape)), v.dtype)
                for name, v in self.hf_views(current=False)}

    def accepted_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """What a push may carry: the model's tensors, and for tied embeddings the copy of
        lm_head.weight that a trainer's state_dict() holds (see untie_pushed)."""
        accepted = self.expected_weights()
        if self.mc.tie_word_embeddings and self.lm_head is not None:
            accepted["lm_head.weight"] = accepted[self.mc.text_prefix + "embed_tokens.weight"]
        for name in self._aliases:
            view = self.hf_view(name, current=False)
            accepted[name] = (self.hf_shard(name).full_shape(tuple(view.shape)), view.dtype)
        return accepted

    def split_fused_experts(self, staged: dict[str, torch.Tensor]) -> None:
        """Replace pushed in-memory expert names (see _fused_expert_names) by the checkpoint names
        they hold, as views of the staged tensors, so that the rest of an update sees one naming.
        A tensor pushed under both names is refused: which one should win is not clear."""
        for name in [n for n in staged if n in self._aliases]:
            t = staged.pop(name)
            layer = name.rsplit("mlp.", 1)[0]
            moe = self.layers[int(layer.rstrip(".").rsplit(".", 1)[1])].moe
            style = moe.cfg.checkpoint_style
            if name.endswith(".gate.weight"):  # Mixtral's router
                targets = [(router_name(layer, style), t)]
            else:  # this replica's experts (the staged slice), empty tensors for the others'
                targets = split_experts(name, t, style, moe.first, moe.cfg.num_experts)
            for target, view in targets:
                if target in staged:
                    raise InvalidRequestError(f"{target} was pushed twice (also inside {name}): push one naming")
                staged[target] = view

    def untie_pushed(self, staged: dict[str, torch.Tensor]) -> None:
        """Drop a pushed lm_head.weight of a tied model (as vLLM does) after checking it equals
        the embedding it is tied to (the pushed one, else the live one)."""
        head = staged.pop("lm_head.weight", None) if self.ties_head else None
        if head is None:
            return
        embed_name = self.embed_name
        embed = staged[embed_name] if embed_name in staged else self.hf_view(embed_name)  # (no catch-up for a pushed one)
        if embed.shape != head.shape:  # the pushed embedding was staged as the head's panels (weight_buffers.py)
            embed = self.lm_head.plain_of(embed, head.shape[0])
        if not torch.equal(head.to(embed.device, embed.dtype), embed):
            raise InvalidRequestError("lm_head.weight differs from model.embed_tokens.weight, but this model ties "
                                      "them (tie_word_embeddings): push equal tensors, or only the embedding")

    def check_weight(self, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
        """Refuse (InvalidRequestError) a tensor this model has no place for: unknown name, wrong
        shape, or (when given) a dtype other than the model's."""
        if name == "lm_head.weight" and self.ties_head:  # see untie_pushed
            name = self.embed_name
        if name not in self._hf and name not in self._aliases:
            raise InvalidRequestError(f"unknown parameter {name!r} (this model has no such tensor)")
        view = self.hf_view(name, current=False)
        want = self.hf_shard(name).full_shape(tuple(view.shape))
        if tuple(shape) != want:
            raise InvalidRequestError(f"{name} has shape {list(shape)}, expected {list(want)}")
        if dtype is not None and dtype != view.dtype:
            raise InvalidRequestError(f"{name} has dtype {dtype}, expected {view.dtype}")

    def checkpoint_tensors(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of a safetensors checkpoint (folder, shards + index, or one file) that this
        model keeps: a tied checkpoint's copy of lm_head and rotary caches are skipped. The one
        reader for start-up and for updates from disk."""
        tied_head = self.mc.tie_word_embeddings or self.score is not None  # (a classifier has no LM head)
        for name, t in load_safetensors_folder(path):
            if name not in self._hf and ((name == "lm_head.weight" and tied_head) or "rotary_emb" in name):
                continue
            yield name, t

    def load_weights(self, path: str) -> None:
        """Load a whole checkpoint in place (start-up, reload_weights)."""
        missing = set(self._hf)
        try:
            for name, t in self.checkpoint_tensors(path):
                self.check_weight(name, tuple(t.shape))
                self.hf_view(name).copy_(self.shard_of(name, t))
                missing.discard(name)
        except (InvalidRequestError, ValueError, FileNotFoundError) as e:
            raise UnsupportedModelError(f"{path}: {e}") from e
        if missing:
            raise UnsupportedModelError(f"{path}: missing tensors, e.g. {sorted(missing)[:3]}")
        self.repack()

    def checked_local(self, tensors: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """Tensors that are this rank's slices already (a sharded_state folder), each checked
        against its view; every one of the model's must be there."""
        missing = sorted(set(self._hf) - set(tensors))
        if missing:
            raise UnsupportedModelError(f"{source}: missing tensors, e.g. {missing[:3]}")
        for name, t in tensors.items():
            if name not in self._hf:
                raise UnsupportedModelError(f"{source}: unknown tensor {name!r}")
            view = self.hf_view(name)
            if t.shape != view.shape:
                raise UnsupportedModelError(f"{source}: {name} has shape {list(t.shape)}, this rank holds "
                                            f"{list(view.shape)}")
        return {name: t.to(self.dtype) for name, t in tensors.items()}

    def load_local(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Load this rank's slices in place (start-up from a sharded_state folder)."""
        for name, t in self.checked_local(tensors, source).items():
            self.hf_view(name).copy_(t)
        self.repack()

    def drop_packed(self) -> None:
        self._catch_up()
        self.drop_decode_plan()
        for lin in self._linears():
            lin.pack(None, False)

    def repack(self, linears: list[Linear] | None = None) -> None:
        """Refresh the packed matmul weights from the plain tensors (after any weight write; of
        `linears` only, default all). Batch-invariant mode packs the float32 panels, whose every
        output is one FMA chain in k order, and never oneDNN's copy (its blocking follows the rows)."""
        enable = self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32)
        ext = cpu_ext.ops_for(self.device, self.dtype) if enable else None
        onednn = enable and not self.batch_invariant and _mkldnn_ok(self.dtype)
        self.drop_decode_plan()  # it holds the packed tensors
        linears = self._linears() if linears is None else linears
        self._catch_up(linears)  # (a layout change packs from the plain weights)
        for lin in linears:
            lin.pack(ext, onednn)

    def panels_written(self, linears: list[Linear]) -> None:
        """A weight update wrote these linears' panels (a trainer packed its tensors into them,
        engine/worker/weight_buffers.py): every step reads the panels alone (Linear.panels_serve),
        and the plain weights are unpacked from them only when read (checksums, saves, a partial
        push into the same tensor, sleep): most updates are never read back. A tied embedding
        is read out of the head's panels meanwhile (`_embed_rows`)."""
        self.drop_decode_plan()
        self._behind.update((id(lin), lin) for lin in linears)

    def _catch_up(self, linears: list[Linear] | None = None) -> None:
        for lin in list(self._behind.values()) if linears is None else linears:
            if self._behind.pop(id(lin), None) is not None:
                lin.unpack()

    def drop_decode_plan(self) -> None:
        """Forget the decode plan, which holds the packed weights and the KV cache (they are about to
        change or go): the next all-decode step makes a new one."""
        self._plan, self._plan_kv, self._plan_rows = None, None, 0

    def _decode_plan(self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        """The C++ plan of an all-decode step over these caches (made and kept on first use), or
        None where one of its ops is not a C++ kernel here (no kernels, another device, tensor
        parallelism, a mixture of experts, a projection without our packed copy)."""
        if self._plan_kv is kv_caches:
            return self._plan
        self._plan, self._plan_kv, self._plan_rows = None, kv_caches, 0
        ext = self.ops.ext
        if ext is None or self.tp is not None or any(layer.moe is not None for layer in self.layers):
            return None
        kinds = {ext.bf16_vnni_linear: 0, ext.bf16_amx_linear: 1, ext.f32_panel_linear: 2, ext.bf16_panel_linear: 3}
        linears = [lin for layer in self.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        if any(lin.panels is None or lin.panel_linear not in kinds for lin in linears):
            return None
        plan = ext.DecodePlan(self.num_heads, self.num_kv_heads, self.mc.head_dim, self.mc.rms_norm_eps,
                              self.scale, self.mc.sliding_window or 0, self.cos_sin, self.norm)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            plan.add_layer([layer.input_norm, layer.q_norm, layer.k_norm, layer.post_norm],
                           [(lin.panels, lin.weight.shape[0], lin.bias, kinds[lin.panel_linear])
                            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)], k_cache, v_cache)
        self._plan, self._plan_rows = plan, min(lin.panel_max for lin in linears)
        return plan

    def _embed_rows(self, input_ids: torch.Tensor) -> torch.Tensor:
        head = self.lm_head
        if head is not None and head.weight is self.embed and id(head) in self._behind:
            return head.rows(input_ids)  # (a push wrote the tied head's panels alone: see panels_written)
        return F.embedding(input_ids, self.embed)

    @property
    def embed_name(self) -> str:
        return self.mc.text_prefix + "embed_tokens.weight"

    @property
    def ties_head(self) -> bool:
        """Whether the LM head is the embedding (a pushed lm_head.weight is then checked and dropped)."""
        return self.mc.tie_word_embeddings and self.lm_head is not None

    def weight_storages(self) -> list[tuple[torch.Tensor, list[str], bool]]:
        """Every tensor that holds weights (the base of the HF views: the fused qkv, the
        embedding, ...), the HF names that live in it, and whether they fill it whole (by
        construction they do; a storage they did not fill could never be swapped in)."""
        roots: dict[int, tuple[torch.Tensor, list[str], list[int]]] = {}
        for name, (tensor, _, rows, _) in self._hf.items():  # (from the map: no view is made)
            root = tensor._base if tensor._base is not None else tensor
            if root.numel():
                _, names, numel = roots.setdefault(id(root), (root, [], [0]))
                names.append(name)
                numel[0] += rows * (tensor.numel() // tensor.shape[0])
        return [(root, names, numel[0] == root.numel()) for root, names, numel in roots.values()]

    def weights_moved(self, storages: set[int]) -> None:
        """The storages with these ids (see weight_storages) hold new values, some of them
        swapped in by `set_`: views of them are taken afresh, and the linears whose weight they
        are repacked (a bias is read as it is, by every kernel)."""
        self._hf = self._hf_name_map()
        self._aliases = self._fused_expert_names()
        self.drop_decode_plan()
        moved = [lin for lin in self._linears() if id(lin.weight) in storages]
        for lin in moved:  # (their plain weights are what was written: whole, or caught up before a partial write)
            self._behind.pop(id(lin), None)
        self.repack(moved)

    # ---- forward ------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora=None,
                mm: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """input_ids, positions: (T,). Returns the final-normed hidden states (T, hidden).
        lora: the step's engine.worker.lora.LoRABatch (adds each token's adapter delta to the projections).
        mm: (rows, embeddings): the vision encoder's outputs replace those rows' token embeddings."""
        mc, tp = self.mc, self.tp
        T = input_ids.shape[0]
        q_size, D, eps = self.q_size, mc.head_dim, mc.rms_norm_eps
        Hq, Hkv = self.num_heads, self.num_kv_heads
        slots, cos_sin, scale, window = md.slot_mapping, self.cos_sin, self.scale, mc.sliding_window
        ops = self.ops
        add_norm, rope, silu = ops.add_norm, ops.rope_and_cache, ops.silu_and_mul
        decode = ops.decode_attention if md.num_decodes == T else None  # the whole step is decodes
        assert decode is not None or not self.batch_invariant, "batch-invariant steps are all decode rows"
        table, lens = md.decode_block_table, md.decode_seq_lens
        h = self._embed_rows(input_ids) if tp is None else self._embed_sharded(input_ids)  # (T, H)
        if mm is not None:
            h.index_copy_(0, mm[0], mm[1].to(h.dtype))
        elif decode is not None and lora is None and self.use_decode_plan:
            plan = self._decode_plan(kv_caches)
            if plan is not None and T <= self._plan_rows:
                return plan.run(h, positions, slots, table, lens)
        residual = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x, residual = add_norm(h, residual, layer.input_norm, eps)
            qkv = layer.qkv(x)  # (T, q_size + 2 * kv_size)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            # (Qwen3: per-head RMSNorm of q and k first), rotate q and k, write k and v: one call
            q, _ = rope(qkv, positions, cos_sin, k_cache, v_cache, slots, Hq, Hkv, D, layer.q_norm, layer.k_norm, eps)
            if decode is not None:
                a = decode(q, k_cache, v_cache, table, lens, scale, window or 0).view(T, q_size)
            else:
                a = attention(q, k_cache, v_cache, md, scale, window)
            h = layer.o(a)  # (T, H); with tp a partial sum (LoRA's delta included: it is linear in a)
            if lora is not None:
                lora.apply(i, "o", a, h)
            if tp is not None:
                tp.all_reduce_(h)
            x, residual = add_norm(h, residual, layer.post_norm, eps)
            if layer.moe is not None:
                h, experts = layer.moe(x)
                if self.routing is not None:
                    self.routing[slots, i] = experts.to(torch.int16)
                continue
            gate_up = layer.gate_up(x)
            if lora is not None:
                lora.apply(i, "gate_up", x, gate_up)
            act = silu(gate_up)
            h = layer.down(act)
            if lora is not None:
                lora.apply(i, "down", act, h)
            if tp is not None:
                tp.all_reduce_(h)
        return add_norm(h, residual, self.norm, eps)[0]

    def idle_step(self) -> None:
        """A step without tokens under expert parallelism: serve the other replicas' tokens in
        every MoE layer, in the order a forward pass reaches them (engine/model/moe.py)."""
        for layer in self.layers:
            if layer.moe is not None:
                layer.moe.idle_step()

    def _embed_sharded(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel embedding: each rank looks up the ids in its rows, zeros elsewhere,
        and the all-reduce adds the one non-zero row of every token."""
        start, count = self.part.vocab
        local = input_ids - start
        outside = (local < 0) | (local >= count)
        h = self._embed_rows(local.masked_fill(outside, 0))
        h.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce_(h)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """(N, hidden) pooled states -> (N, num_labels) label logits (a sequence classifier's head)."""
        return self.score(pooled)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, vocab) in the model's dtype (the sampler reads bf16 as it is when
        it can, and converts to float32 where it computes more than an argmax). With tensor
        parallelism every rank computes its vocabulary columns and rank 0 gathers them (it alone
        samples); the other ranks get None."""
        logits = self.lm_head(hidden)
        if self.tp is None:
            return logits
        parts = gather_along(self.tp, logits, 1, [p.vocab[1] for p in self.partitions])
        return None if parts is None else torch.cat(parts, dim=1)


_MKLDNN_OK: dict[torch.dtype, bool] = {}


def _mkldnn_ok(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear works here in `dtype` and gives F.linear's result (bf16:
    bit for bit; float32: to float32 rounding, the sums run in another order)."""
    if dtype not in _MKLDNN_OK:
        try:
            w = torch.randn(64, 32).to(dtype)
            x = torch.randn(4, 32).to(dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
            y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            ref = F.linear(x, w)
            _MKLDNN_OK[dtype] = bool(torch.equal(y, ref) if dtype == torch.bfloat16
                                     else torch.allclose(y, ref, rtol=1e-5, atol=1e-5))
        except (RuntimeError, AttributeError):
            _MKLDNN_OK[dtype] = False
    return _MKLDNN_OK[dtype]
