"""Stub (see vllm/__init__.py): TRL's init_communicator asks it for the trainer's address."""


def get_ip() -> str:
    return "127.0.0.1"
