"""Lockstep for expert parallelism: the replicas of an expert-parallel engine step together.

With experts split between replicas (engine/model/moe.py) every forward pass holds all-to-alls
across all replicas, so while any replica has work every replica must run a forward pass per
step: its own batch, or an idle one that only serves the others' tokens (vLLM's dummy batch).
As in vLLM, steps come in request *waves*:

    idle  -- work arrives at a replica --> it enters wave w and tells the coordinator (START_DP_WAVE)
          -- the coordinator publishes "wave w" --> every idle replica enters it
    in a wave, each iteration: one all-reduce of [has work, barrier call ready, barrier call pending]
          any work               -> every replica steps (an idle forward where it has none)
          barrier call ready on all -> every replica runs it, in this same iteration
          nothing anywhere       -> the wave ends on every replica at once (w + 1; replica 0
                                    reports it to the coordinator)

Control verbs and waves: a call that changes or blocks on the weights (sleep, wake-up, weight
staging and commit, weight groups, reload, collective_rpc, ...) is a *barrier call*: queued, and
run by every replica in the same iteration once every replica has it, so no replica frees,
swaps or blocks its experts while another one's forward pass needs them (the deadlock vLLM's
RFC #32103 reports). A barrier call that answers later (a sleep that waits for requests to
finish, a group that forms in a thread) stays at the head of the queue until it is done on every
replica, and finishes on all in one iteration. Local calls (pause, resume, stats, cache resets)
run at once, as without expert parallelism: a paused replica keeps joining the others' steps.
A barrier call that not every replica receives within BARRIER_WAIT_S fails on its own.
"""
import time
from dataclasses import dataclass, field
from typing import Any

import torch

# calls that touch neither the weights nor the step's collectives: answered at once
LOCAL_CALLS = frozenset({"pause_generation", "resume_generation", "is_paused", "is_sleeping", "get_stats",
                         "reset_prefix_cache", "reset_encoder_cache", "reset_mm_cache", "get_weight_version",
                         "set_weight_version", "weights_checksum", "list_loras", "start_profile", "stop_profile",
                         "save_weights", "save_sharded_state"})
BARRIER_WAIT_S = 30.0
IDLE_SPIN_S = 0.001  # a wave with only a barrier call that not every replica has yet: poll gently


@dataclass
class BarrierCall:
    client: int
    call_id: int
    method: str
    kwargs: dict
    since: float = field(default_factory=time.monotonic)
    deferred: Any = None  # engine.core.engine_core.Deferred once started, if it answers later


class Lockstep:
    """This replica's side of the waves: the wave number, and the per-iteration all-reduce over
    the expert-parallel group (weight_sync.WeightTransferGroup)."""

    def __init__(self, group):
        self.group = group
        self.size = group.world_size
        self.rank = group.rank
        self.wave = 0  # waves completed
        self.in_wave = False
        self._flags = torch.zeros(3, dtype=torch.int64)

    def sync(self, work: bool, ready: bool, pending: bool) -> tuple[int, int, int]:
        """How many replicas have work, a barrier call ready at the head of their queue, one pending."""
        f = self._flags
        f[0], f[1], f[2] = int(work), int(ready), int(pending)
        self.group.all_reduce_sum_(f)
        return int(f[0]), int(f[1]), int(f[2])

    def join(self, wave: int) -> None:
        """A START_DP_WAVE for `wave`: enter it unless it is over here already (a repeat)."""
        if not self.in_wave and wave >= self.wave:
            self.wave, self.in_wave = wave, True
