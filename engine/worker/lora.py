"""LoRA adapters from PEFT folders: loading and checking (`load_adapter`), and applying the adapters
of a batch's requests to the fused projections of engine.model.decoder (`LoRABatch`).

    LoRARequest(lora_name, lora_int_id, lora_path)     vLLM's fields; id 0 is the base model

A PEFT LoRA folder holds adapter_config.json (r, lora_alpha, target_modules, use_rslora, ...) and
adapter_model.safetensors with `base_model.model.<HF module>.lora_A.weight` (r, in) and `lora_B.weight`
(out, r) per target module; module m's delta is scale * B_m A_m x. The engine fuses q/k/v and
gate/up into one matmul each, and so does an adapter: per decoder layer and fused projection
("qkv", "o", "gate_up", "down") it keeps one Fused(At, Bt): At = [A_q; A_k; A_v].T (in, sum r)
and Bt the block-diagonal (sum r, out) of the scaled B_m.T placed at each module's output
columns, so a projection's whole delta is two matmuls, (x @ At) @ Bt, added in place. (Zero blocks
cost a few FLOPs; fewer, larger calls are what matters on a CPU.) On CPUs whose model linears run
on our float32 panels, both matmuls do too (PanelDelta).

Registered vs resident (as in vLLM): add_lora registers an adapter with the engine core
(engine/core/lora_registry.py; checked now, a bad one refused) until remove_lora; at most
max_loras are resident in the worker (list_loras), pinned ones (pin_lora, and every pushed adapter:
its weights exist nowhere else) among them. A request may name any registered adapter whatever its
residency: the scheduler admits a request only while the running requests' adapters and the pinned
ones fit in max_loras (otherwise it waits for a slot), and before each step the core loads the
step's evicted adapters from their folders, evicting the least recently used one that is neither
pinned nor running. A request for an unregistered id is an InvalidRequestError ("not loaded"); one
that could never get a slot (every slot pinned) is an EngineStateError, and so is a pin that would
leave requests no slot.

With tensor parallelism each rank fuses its slice of an adapter, cut like its base projection
(engine/model/parallel.py): lora_B by output rows where the projection is column-parallel (q, k, v,
gate, up), lora_A by input columns where it is row-parallel (o, down). A row-parallel delta
(x_r A_r) B is then a partial sum like the projection's own output, and the one all-reduce after
it adds both. The adapter's PEFT tensors stay whole on every rank (pushes and exports name them).

Refused with an InvalidRequestError naming the problem (nothing is loaded): a missing folder or
file, weights that are not safetensors, another PEFT method or DoRA, biases, rank above
max_lora_rank, per-module rank or alpha patterns, modules the engine has no place for (embeddings,
lm_head, modules_to_save), a layer the model does not have, a wrong shape.
"""
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.model.decoder import f32_panels_serve
from engine.model.parallel import Partition
from kernels import cpu_ext


class LoRARequest(msgspec.Struct, frozen=True):
    lora_name: str
    lora_int_id: int
    lora_path: str


# HF module -> the fused projection of engine.model.decoder it is part of (in this order within it)
MODULES = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o", "gate_proj": "gate_up",
           "up_proj": "gate_up", "down_proj": "down"}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_ADAPTER_SEGMENT = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


class PanelDelta:
    """(x @ At) @ Bt in float32 through the C++ float32 panels (kernels/csrc/f32_linear.cpp), where
    the model's own linears run on panels too (_panel_kernels). torch's matmuls at these shapes
    (a few rank columns) cost more than the projection they add to: in bf16 on an AVX2 CPU (no
    oneDNN bf16 there) an adapter took a batch-32 step to ~0.2x of the base model's speed, and in
    float32 to ~0.65-0.9x. The delta comes back in float32 and is rounded once, by the add into y."""

    __slots__ = ("ext", "A", "B", "rank", "width")

    def __init__(self, ext, At: torch.Tensor, Bt: torch.Tensor):
        self.ext, self.rank, self.width = ext, At.shape[1], Bt.shape[1]
        self.A = ext.f32_panel_pack(At.T.float().contiguous(), None)  # A (rank, in) as a linear's weight
        self.B = ext.f32_panel_pack(Bt.T.float().contiguous(), None)  # B (out, rank)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        xa = self.ext.f32_panel_linear(x.float(), self.A, self.rank, None)
        if mask is not None:
            xa.masked_fill_(mask, 0.0)
        return self.ext.f32_panel_linear(xa, self.B, self.width, None)


def _panel_kernels(dtype: torch.dtype, device: torch.device):
    """The C++ kernels where this model's LoRA deltas go through PanelDelta (where its linears
    run on the float32 panels), else None."""
    ext = cpu_ext.ops_for(device, dtype)
    return ext if f32_panels_serve(ext, dtype) else None


@dataclass
class Fused:
    At: torch.Tensor  # (in, sum of the modules' ranks)
    Bt: torch.Tensor  # (sum of ranks, out of the fused projection): block-diagonal, scaled
    panels: PanelDelta | None = None  # where set, the delta goes through it (see PanelDelta)


@dataclass
class Adapter:
    request: LoRARequest
    fused: list[dict[str, Fused]]  # per layer: fused projection -> its adapter
    tensors: dict[str, torch.Tensor]  # the PEFT tensors (float32, unscaled): a push replaces some of them
    rank: int
    scale: float


def module_shapes(mc: ModelConfig, part: Partition | None = None) -> dict[str, tuple[int, int, int]]:
    """HF module -> (first output row in its fused projection, out_features, in_features), of the
    whole model or of one tensor-parallel rank's `part`."""
    H, inter, q, kv = _sizes(mc, part)
    return {"q_proj": (0, q, H), "k_proj": (q, kv, H), "v_proj": (q + kv, kv, H), "o_proj": (0, H, q),
            "gate_proj": (0, inter, H), "up_proj": (inter, inter, H), "down_proj": (0, H, inter)}


def _sizes(mc: ModelConfig, part: Partition | None) -> tuple[int, int, int, int]:
    """(hidden, intermediate, q rows, kv rows) of the whole model or of one rank."""
    if part is None:
        return mc.hidden_size, mc.intermediate_size, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    return mc.hidden_size, part.intermediate[1], part.q_heads[1] * mc.head_dim, part.kv_heads[1] * mc.head_dim


def _rank_slice(module: str, ab: str, t: torch.Tensor, mc: ModelConfig, part: Partition | None) -> torch.Tensor:
    """A rank's slice of one PEFT tensor (see the module docstring)."""
    if part is None or not part.sharded:
        return t
    D = mc.head_dim
    kv = (part.kv_heads[0] * D, part.kv_heads[1] * D)
    rows = {"q_proj": (part.q_heads[0] * D, part.q_heads[1] * D), "k_proj": kv, "v_proj": kv,
            "gate_proj": part.intermediate, "up_proj": part.intermediate}
    cols = {"o_proj": (part.q_heads[0] * D, part.q_heads[1] * D), "down_proj": part.intermediate}
    if ab == "B" and module in rows:
        return t.narrow(0, *rows[module])
    if ab == "A" and module in cols:
        return t.narrow(1, *cols[module])
    return t


def load_adapter(request: LoRARequest, mc: ModelConfig, max_rank: int, dtype: torch.dtype,
                 device: torch.device, part: Partition | None = None) -> Adapter:
    def bad(problem: str) -> InvalidRequestError:
        return InvalidRequestError(f"LoRA adapter {request.lora_name!r} ({request.lora_path}): {problem}", "lora_path")

    folder = Path(request.lora_path)
    if not (folder / "adapter_config.json").is_file():
        raise bad("no adapter_config.json (not a PEFT adapter folder)")
    if not (folder / "adapter_model.safetensors").is_file():
        raise bad("no adapter_model.safetensors (only safetensors adapters load)")
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise bad(f"adapter_config.json is not JSON ({e})") from e
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora"):
        raise bad(f"only plain LoRA adapters load (peft_type {cfg.get('peft_type')!r}, use_dora {cfg.get('use_dora')})")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias") or cfg.get("modules_to_save"):
        raise bad("adapters with biases or modules_to_save are not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise bad("per-module rank_pattern / alpha_pattern are not supported")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise bad(f"r must be a positive int and lora_alpha a number (r={rank!r}, lora_alpha={alpha!r})")
    if rank > max_rank:
        raise bad(f"rank {rank} is above max_lora_rank {max_rank}")
    targets = cfg.get("target_modules") or []
    targets = list(MODULES) if targets == "all-linear" else targets
    # (PEFT saves "all-linear" as full module paths: model.layers.0.self_attn.q_proj, ...)
    if isinstance(targets, str) or not {t.split(".")[-1] for t in targets} <= set(MODULES):
        raise bad(f"target_modules {targets!r}: the engine applies LoRA to {', '.join(MODULES)} only")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    try:
        tensors = load_file(folder / "adapter_model.safetensors")
    except Exception as e:  # a truncated or corrupt file
        raise bad(f"adapter_model.safetensors cannot be read ({e})") from e
    if not tensors:
        raise bad("adapter_model.safetensors holds no LoRA weights")
    shapes = adapter_shapes(tensors, mc, rank, bad)
    for key, t in tensors.items():
        if tuple(t.shape) != shapes[key]:
            raise bad(f"{key} has shape {list(t.shape)}, expected {list(shapes[key])}")
    return build_adapter(request, {k: t.float() for k, t in tensors.items()}, rank, scale, mc, dtype, device, part)


def adapter_shapes(tensors: dict, mc: ModelConfig, rank: int, bad) -> dict[str, tuple]:
    """The shape each of an adapter's tensors must have (every lora_A with its lora_B); `bad(problem)`
    makes the refusal."""
    shapes, modules = {}, module_shapes(mc)
    for key in tensors:
        m = _KEY.match(key)
        if m is None or m.group(2) not in MODULES:
            raise bad(f"unexpected tensor {key!r} (the engine has no place for it)")
        if int(m.group(1)) >= mc.num_layers:
            raise bad(f"{key}: the model has {mc.num_layers} layers")
        _, out_f, in_f = modules[m.group(2)]
        shapes[key] = (rank, in_f) if m.group(3) == "A" else (out_f, rank)
        pair = key[:-len("lora_A.weight")] + ("lora_B.weight" if m.group(3) == "A" else "lora_A.weight")
        if pair not in tensors:
            raise bad(f"{key} comes without {pair} (lora_A and lora_B go together)")
    return shapes


def peft_key(name: str) -> str:
    """A trainer's PEFT parameter name as saved in adapter_model.safetensors: the adapter-name
    segment dropped (...q_proj.lora_A.default.weight -> ...q_proj.lora_A.weight)."""
    return _ADAPTER_SEGMENT.sub(r".lora_\1.weight", name)


def build_adapter(request: LoRARequest, tensors: dict[str, torch.Tensor], rank: int, scale: float,
                  mc: ModelConfig, dtype: torch.dtype, device: torch.device, part: Partition | None = None) -> Adapter:
    """Fuse checked float32 PEFT tensors (adapter_shapes) into the per-layer projections (of one
    tensor-parallel rank's `part`: its slices)."""
    shapes = module_shapes(mc, part)
    parts: list[dict[str, list]] = [{} for _ in range(mc.num_layers)]  # fused -> [(row, A, B)]
    pairs = sorted({(int(m.group(1)), m.group(2), key[:-len("A.weight")]) for key in tensors
                    if (m := _KEY.match(key)) and m.group(3) == "A"},
                   key=lambda p: (p[0], list(MODULES).index(p[1])))
    for layer, module, prefix in pairs:
        A = _rank_slice(module, "A", tensors[prefix + "A.weight"], mc, part)
        B = _rank_slice(module, "B", tensors[prefix + "B.weight"], mc, part)
        parts[layer].setdefault(MODULES[module], []).append((shapes[module][0], A, B * scale))
    widths, ext = fused_widths(mc, part), _panel_kernels(dtype, device)
    fused = [{name: _fuse(ps, widths[name], dtype, device, ext) for name, ps in layer.items()} for layer in parts]
    return Adapter(request, fused, tensors, rank, scale)


def fused_widths(mc: ModelConfig, part: Partition | None = None) -> dict[str, int]:
    H, inter, q, kv = _sizes(mc, part)
    return {"qkv": q + 2 * kv, "o": H, "gate_up": 2 * inter, "down": H}


def _fuse(parts: list, width: int, dtype, device, ext) -> Fused:
    At = torch.cat([A for _, A, _ in parts]).T  # (in, R)
    Bt = torch.zeros(At.shape[1], width)
    r0 = 0
    for row, A, B in parts:
        Bt[r0:r0 + A.shape[0], row:row + B.shape[0]] = B.T
        r0 += A.shape[0]
    At, Bt = At.to(device, dtype).contiguous(), Bt.to(device, dtype).contiguous()
    return Fused(At, Bt, PanelDelta(ext, At, Bt) if ext is not None else None)


class LoRABatch:
    """The adapters of one step's tokens: `apply(layer, name, x, y)` adds each token's adapter
    delta to y = projection(x), in place; rows of the base model are left alone.

    One adapter on every row: y += (x @ At) @ Bt. Otherwise the step's adapters' At and Bt side by
    side (stacked once per set of adapters, kept across steps in `stacks`), and each row keeps
    only its own adapter's columns of x @ At_all (a mask): two matmuls per projection whatever the
    number of adapters (the extra FLOPs are x times a few ranks; calls are what costs)."""

    __slots__ = ("adapters", "row_owner", "stacks")

    def __init__(self, adapters: list[Adapter], row_owner: torch.Tensor | None, stacks: dict):
        self.adapters = adapters  # those in this step
        self.row_owner = row_owner  # (T, 1) index into adapters (-1: the base model); None: adapters[0] everywhere
        self.stacks = stacks  # (layer, name) -> Stacked (or None: no adapter of the step has it) for these adapters

    def apply(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.row_owner is None:
            f = self.adapters[0].fused[layer].get(name)
            if f is None:
                return
            if f.panels is not None:
                y.add_(f.panels(x))
            else:
                y.addmm_(x @ f.At, f.Bt)
            return
        key = (layer, name)
        if key not in self.stacks:
            self.stacks[key] = self._stack(layer, name)
        stack = self.stacks[key]
        if stack is None:
            return
        mask = stack.owner != self.row_owner
        if stack.panels is not None:
            y.add_(stack.panels(x, mask))
        else:
            y.addmm_((x @ stack.At).masked_fill_(mask, 0.0), stack.Bt)

    def _stack(self, layer: int, name: str) -> "Stacked | None":
        parts = [(i, a.fused[layer][name]) for i, a in enumerate(self.adapters) if name in a.fused[layer]]
        if not parts:
            return None
        owner = torch.cat([torch.full((f.At.shape[1],), i, dtype=torch.int64) for i, f in parts])
        At, Bt = torch.cat([f.At for _, f in parts], dim=1), torch.cat([f.Bt for _, f in parts])
        ext = parts[0][1].panels.ext if parts[0][1].panels is not None else None
        return Stacked(At, Bt, owner.to(At.device)[None, :], PanelDelta(ext, At, Bt) if ext is not None else None)


@dataclass
class Stacked:
    """The adapters of a step side by side, for one layer's fused projection (LoRABatch)."""
    At: torch.Tensor  # (in, R_all)
    Bt: torch.Tensor  # (R_all, out)
    owner: torch.Tensor  # (1, R_all): the index of the adapter each column of x @ At belongs to
    panels: PanelDelta | None
