"""Stub (see vllm/__init__.py)."""
from vllm import _Stub


class StructuredOutputsParams(_Stub):
    pass
