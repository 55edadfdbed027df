"""Worker: one model replica (weights, KV cache tensors, forward pass). It is the target of
`collective_rpc`: any public method of the worker, or of the worker extension class named in
the config (how RL frameworks add `update_weights`-style methods), can be called by name.
"""
import importlib

from engine.config import EngineConfig
from engine.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0):
        self.config = config
        self.rank = rank
        self.model_runner = ModelRunner(config)

    @property
    def model(self):
        return self.model_runner.model

    def get_rank(self) -> int:
        return self.rank

    def ping(self, value=None):
        return value

    def model_info(self) -> dict:
        mc = self.config.model_config
        return {"architecture": mc.architecture, "dtype": self.config.dtype, "device": self.config.device,
                "num_parameters": sum(v.numel() for _, v in self.model.hf_views())}


def worker_class(extension: str | None) -> type:
    """Worker, or Worker with the extension class mixed in ("package.module.Class" or
    "package.module:Class"); the extension's methods see `self` as the worker."""
    if not extension:
        return Worker
    module_name, _, cls_name = extension.replace(":", ".").rpartition(".")
    try:
        ext = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"worker_extension_cls {extension!r} cannot be imported: {e}") from e
    if not isinstance(ext, type):
        raise ValueError(f"worker_extension_cls {extension!r} is not a class")
    return type(f"Worker[{cls_name}]", (ext, Worker), {})
