"""The routed experts of a mixture-of-experts decoder layer (Qwen3-MoE, Mixtral), and expert
parallelism across data-parallel replicas.

    x (T, H) -> router logits (T, E) -> top-k ids and weights (kernels.moe.route)
             -> each token's experts' SwiGLU MLPs, weighted and summed (kernels.moe.fused_experts)

Weights: w13 (E, 2I, H) = each expert's [gate; up] rows, w2 (E, H, I): transformers' fused
layout, so a trainer's `mlp.experts.gate_up_proj` is one copy and the checkpoints' per-expert
names are views.

Expert parallelism (`enable_expert_parallel`, engine/worker/expert_parallel.py): the N replicas of
a data-parallel engine form one group and replica r holds experts split(E, N, r) (contiguous,
the first E % N replicas one more). Every other part of the model is replicated. Per MoE layer,
each replica

    1. sends every (token, expert) pair's hidden row to the replica holding the expert, and the
       expert's local id beside it (all-to-all: the counts, then rows and ids);
    2. runs its experts on what it received (the same fused kernel, weight 1);
    3. sends the outputs back (all-to-all), and sums each token's k outputs, weighted, in
       ascending expert id: the arithmetic of the single-replica path, so results agree with it
       and with transformers.

A replica with no tokens in a step still takes part with zero rows (`ExpertParallel.idle_step`):
the others' tokens may need its experts. The engine core keeps the replicas stepping in lockstep
(engine/process/waves.py).
"""
from typing import Protocol

import torch

from engine.config import MoEConfig
from engine.model.parallel import split
from kernels.moe import fused_experts, route


class EPGroup(Protocol):
    """The collectives between the replicas of an expert-parallel engine (weight_sync.WeightTransferGroup)."""

    rank: int
    world_size: int

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, output_counts: list[int],
                   input_counts: list[int]) -> torch.Tensor: ...


class MoE:
    """One layer's router and experts (this replica's experts under expert parallelism)."""

    __slots__ = ("cfg", "router", "w13", "w2", "first", "count", "ep", "starts", "bounds")

    def __init__(self, cfg: MoEConfig, hidden: int, router, dtype: torch.dtype, device: torch.device,
                 ep: EPGroup | None = None):
        self.cfg, self.router, self.ep = cfg, router, ep
        E, I = cfg.num_experts, cfg.intermediate_size
        n, r = (ep.world_size, ep.rank) if ep is not None else (1, 0)
        self.first, self.count = split(E, n, r)
        starts = [split(E, n, q)[0] for q in range(n)]  # the first expert of each replica
        self.starts = torch.tensor(starts, device=device)
        self.bounds = torch.tensor(starts[1:], device=device)  # (bucketize: pair -> replica)
        self.w13 = torch.zeros(self.count, 2 * I, hidden, dtype=dtype, device=device)
        self.w2 = torch.zeros(self.count, hidden, I, dtype=dtype, device=device)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> ((T, H) output, (T, k) int32 expert ids)."""
        ids, weights = route(self.router(x), self.cfg.top_k, self.cfg.renormalize)
        if self.ep is None:
            return fused_experts(x, self.w13, self.w2, ids, weights), ids
        return self._expert_parallel(x, ids, weights), ids

    def idle_step(self) -> None:
        """Serve the other replicas' tokens in a step where this replica has none."""
        k, w = self.cfg.top_k, self.w2
        self._expert_parallel(w.new_empty(0, w.shape[1]), torch.empty(0, k, dtype=torch.int32, device=w.device),
                              torch.empty(0, k, dtype=torch.float32, device=w.device))

    def _expert_parallel(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ep, n = self.ep, self.ep.world_size
        T, k = ids.shape
        flat = ids.flatten().long()  # pair p = (token p // k, slot p % k)
        owner = torch.bucketize(flat, self.bounds, right=True)
        by_owner = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=n).to(torch.int64)
        recv = torch.empty_like(send)
        ep.all_to_all(recv, send, [1] * n, [1] * n)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        local_ids = (flat - self.starts[owner])[by_owner]
        rows = ep.all_to_all(x.new_empty(sum(recv_counts), x.shape[1]), x[by_owner // k], recv_counts, send_counts)
        their_ids = ep.all_to_all(local_ids.new_empty(sum(recv_counts)), local_ids, recv_counts, send_counts)
        ones = torch.ones(rows.shape[0], 1, dtype=torch.float32, device=x.device)
        y = fused_experts(rows, self.w13, self.w2, their_ids[:, None], ones)
        back = ep.all_to_all(x.new_empty(T * k, x.shape[1]), y, send_counts, recv_counts)
        outputs = torch.empty_like(back)
        outputs[by_owner] = back  # in pair order again
        # the single-replica arithmetic: each output weighted in x's dtype, then added per token
        # in ascending expert id (pairs sorted by expert, then token)
        order = torch.argsort(flat * max(T, 1) + torch.arange(T, device=x.device).repeat_interleave(k), stable=True)
        out = torch.zeros_like(x)
        w = weights.to(x.dtype).flatten()
        out.index_add_(0, order // k, outputs[order] * w[order, None])
        return out
