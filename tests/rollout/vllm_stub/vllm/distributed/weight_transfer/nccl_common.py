"""Stub (see vllm/__init__.py): vLLM's NCCL rendezvous, which TRL's init_communicator calls on CUDA."""


def trainer_init(init_info):
    raise NotImplementedError("vllm.distributed.weight_transfer.nccl_common.trainer_init is a test stub")
