"""Weight-version rules of requests (SamplingParams.max_weight_staleness, min_weight_version,
stale_action): which requests a change of the live weights' version catches, and which it lets in.
The scheduler acts on the answers (engine/core/scheduler.py: weights_changed).

    staleness(req) = live version - version of req's OLDEST generated token   (no token yet: 0)

Versions only move at a weight update or a relabel (EngineCore.commit_weights, set_weight_version),
and the engine core applies a move before the next step can generate (during a keep pause: at the
resume, so a chunked update counts once, with the version finish_weight_update gives it). Hence
every token generated since the previous move carries the version live at that move, and the
oldest one is recorded lazily, at the first move after it: nothing is tracked per token or per
step, and a request with neither parameter costs nothing until a version moves.

Base-model versions only: a LoRA adapter's own version (lora_versions) is not counted.
"""
from engine.core.request import Request


class VersionRules:
    """The requests waiting for a weight version, and the count of stale requests by action."""

    def __init__(self):
        self.awaiting: list[Request] = []  # min_weight_version above the live version, in arrival order
        self.num_stale = {"finish": 0, "restart": 0}

    @staticmethod
    def must_wait(req: Request, live_version: int) -> bool:
        v = req.params.min_weight_version
        return v is not None and v > live_version

    def stale(self, requests, old_version: int, new_version: int) -> list[Request]:
        """The requests that the move old_version -> new_version leaves past their
        max_weight_staleness (counted here under their stale_action)."""
        caught = []
        for req in requests:
            if req.oldest_version is None and req.num_output_tokens:
                req.oldest_version = old_version  # its first token came after the previous move
            limit = req.params.max_weight_staleness
            if limit is not None and req.oldest_version is not None and new_version - req.oldest_version > limit:
                self.num_stale[req.params.stale_action] += 1
                caught.append(req)
        return caught

    def release(self, new_version: int) -> list[Request]:
        """The waiting requests whose min_weight_version the live version reached (now admitted)."""
        ready = [r for r in self.awaiting if not self.must_wait(r, new_version)]
        if ready:
            self.awaiting = [r for r in self.awaiting if self.must_wait(r, new_version)]
        return ready
