"""Stub (see vllm/__init__.py): vLLM's packed NCCL broadcast, which TRL's update_named_params calls."""


def packed_nccl_broadcast_producer(*args, **kwargs):
    raise NotImplementedError("vllm.distributed.weight_transfer.packed_tensor.packed_nccl_broadcast_producer "
                              "is a test stub")
