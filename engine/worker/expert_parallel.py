"""The expert-parallel group: one process group over the data-parallel replicas of a
mixture-of-experts engine (engine/model/moe.py sends tokens to their experts through it;
engine/process/waves.py keeps the replicas in lockstep with it). Replica r is rank r
(its data_parallel_rank); replica 0 hosts the rendezvous at config.expert_parallel_address."""
from engine.config import EngineConfig

# a collective waits this long for a slow peer; a dead one closes its sockets and fails it at once
EP_TIMEOUT_S = 600.0


def expert_parallel_group(config: EngineConfig):
    """This replica's end of the group (weight_sync.WeightTransferGroup), or None without expert
    parallelism. Returns once every replica joined."""
    if not config.enable_expert_parallel or config.data_parallel_size == 1:
        return None
    from weight_sync import WeightTransferGroup

    host, port = config.expert_parallel_address.rsplit(":", 1)
    backend = "nccl" if config.device.startswith("cuda") else "gloo"
    return WeightTransferGroup(host, int(port), config.data_parallel_rank, config.data_parallel_size,
                               backend=backend, timeout_s=EP_TIMEOUT_S, device=config.device if backend == "nccl" else None)
