"""A stand-in for the `vllm` package, only so that TRL's "is vllm installed" check passes and its
client modules import: TRL 1.16.0 imports these names at import time (trl/generation/
vllm_generation.py, trl/generation/vllm_client.py) and reads `__version__` (trl/import_utils.py)
to pick its code paths (0.28.0: the stateful trainer engine and /reset_prefix_cache's JSON).
The real wheel pulls CUDA; TRL's HTTP client never calls into it. Everything here raises if used.
tests/rollout/test_compat_trl.py puts this folder on sys.path of its TRL subprocess only."""
__version__ = "0.28.0"


class _Stub:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} is a test stub of vllm (tests/rollout/vllm_stub)")


class LLM(_Stub):
    pass


class RequestOutput(_Stub):
    pass


class SamplingParams(_Stub):
    pass
