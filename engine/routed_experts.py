"""Routing replay: the experts a mixture-of-experts model routed every token to, per layer, handed
to the trainer so that its forward pass can use the same experts (its router may pick others:
numerics differ between the engine and the trainer, and the policy has moved on).

    LlamaModel.forward    routing[slot, layer] = the token's top-k expert ids (int16), for every
                          token it computes, in every MoE layer; dense layers keep -1. One buffer
                          beside the KV cache, indexed by KV slot (ModelRunner allocates it), so a
                          prefix-cache hit still has the rows of the request that computed it.
    ModelRunner           at a request's sampling step: the rows of the positions that became
                          available since its last one, read through its block table
                          -> ModelRunnerOutput.routed_experts[id] = (first position, bytes)
    Scheduler             -> EngineCoreOutput.routed_experts (the same piece, with the token)
    OutputProcessor       RoutedExperts per sequence: pieces placed by position
                          -> CompletionOutput.routed_experts: (num_tokens, num_layers, top_k) int16

num_tokens = prompt + output tokens - 1: every token the model ran through (the last sampled one
never is). A request preempted and recomputed sends the recomputed positions again; they replace
the earlier rows (the KV the later tokens attend to is the recomputed one), except in rows a DELTA
output already handed out. Bytes on the wire are little-endian int16, row-major.
"""
import numpy as np

from engine.errors import InvalidRequestError

DTYPE = np.dtype("<i2")


def routing_shape(config) -> tuple[int, int] | None:
    """(num_layers, top_k) of a routing row, for an EngineConfig that keeps routed experts."""
    mc = config.model_config
    return (mc.num_layers, mc.moe.top_k) if config.enable_return_routed_experts else None


def check_routed_experts(asked: bool, enabled: bool, architecture: str, is_moe: bool) -> None:
    """InvalidRequestError (field return_routed_experts) for a request that asks for routed
    experts from an engine that does not keep them."""
    if not asked or enabled:
        return
    if not is_moe:
        raise InvalidRequestError(f"return_routed_experts: this model ({architecture}) is dense, it has no experts "
                                  "to return (a mixture-of-experts model only)", "return_routed_experts")
    raise InvalidRequestError("return_routed_experts needs the engine started with enable_return_routed_experts=True "
                              "(rollout serve --enable-return-routed-experts)", "return_routed_experts")


class RoutedExperts:
    """One sequence's rows, placed by position. `view()` hands out read-only views without
    copying (a cumulative output per token would otherwise copy the whole array every step); a
    later write into rows a view covers (a recompute after preemption) copies the buffer first,
    so every array handed out stays as it was."""

    def __init__(self, num_layers: int, top_k: int):
        self.num_layers, self.top_k = num_layers, top_k
        self.rows = np.full((0, num_layers, top_k), -1, dtype=DTYPE)
        self.length = 0  # positions [0, length) known
        self.shared = 0  # rows [0, shared) are in views handed out

    def place(self, first: int, data: bytes) -> None:
        rows = np.frombuffer(data, dtype=DTYPE).reshape(-1, self.num_layers, self.top_k)  # (n, L, k)
        end = first + rows.shape[0]
        if end > self.rows.shape[0]:  # a new buffer: the views of the old one keep it
            grown = np.full((max(end, 2 * self.rows.shape[0]), self.num_layers, self.top_k), -1, dtype=DTYPE)
            grown[:self.length] = self.rows[:self.length]
            self.rows, self.shared = grown, 0
        elif first < self.shared:
            self.rows, self.shared = self.rows.copy(), 0
        self.rows[first:end] = rows
        self.length = max(self.length, end)

    def view(self, start: int = 0) -> np.ndarray:
        """Rows [start, length), read-only."""
        v = self.rows[start:self.length]
        v.flags.writeable = False
        self.shared = self.length
        return v

    def empty(self) -> np.ndarray:
        return np.full((0, self.num_layers, self.top_k), -1, dtype=DTYPE)
