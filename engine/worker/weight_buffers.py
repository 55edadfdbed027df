"""Where a weight update is staged before it goes live, and how it goes live.

An update is received and checked in full before any live weight changes (the two-phase update
of engine/core). On a CPU, fresh memory costs page faults worth several copies of what it holds
(first writes into new pages ran 7-10x slower than a copy into touched ones on the machines we
measured, benchmarks/weight_transfer.py), so staging into fresh tensors and copying them in made
a push cost many copies. Instead the worker keeps a spare: one tensor per weight storage of the
model (the fused qkv, the embedding, ...), laid out alike. An update writes every tensor straight
into the spare's view of it (`dest`), and `commit` then swaps each storage whose every tensor
came with the update (its old storage becomes the next update's spare; nothing is copied) and
copies the pushed tensors of the others (a partial update costs what it moves). The spare is
made on the first update and kept: it costs one copy of the weights in memory, which the update
needed anyway while it was staged; sleep releases it.

On CUDA, allocation is cheap and memory is scarce: tensors are staged into fresh memory and
copied in (no spare).
"""
from __future__ import annotations

import torch

from engine.model.decoder import LlamaModel


class WeightBuffers:
    """A worker's staging memory for base-weight updates (one per worker; see the module doc)."""

    def __init__(self):
        self._model: LlamaModel | None = None
        self._spare: dict[int, torch.Tensor] = {}  # id(root storage tensor) -> its spare

    def release(self) -> None:
        """Drop the spare (sleep; a model that is replaced)."""
        self._model, self._spare = None, {}

    def dest(self, model: LlamaModel, name: str) -> torch.Tensor:
        """Where an update writes the tensor `name` (this rank's part of it): its view in the
        spare, or a fresh tensor (CUDA; a tied model's lm_head.weight, compared, then dropped)."""
        view = model.hf_view(model.embed_name if name == "lm_head.weight" and model.ties_head else name)
        spare = self._spare_of(model, view) if name != "lm_head.weight" or not model.ties_head else None
        return spare if spare is not None else torch.empty_like(view)

    def _spare_of(self, model: LlamaModel, view: torch.Tensor) -> torch.Tensor | None:
        if model.device.type != "cpu":
            return None
        if self._model is not model:
            self._model, self._spare = model, {}
        root = view._base if view._base is not None else view
        spare = self._spare.get(id(root))
        if spare is None:
            if not root.is_contiguous() or root.storage_offset() != 0:
                return None
            spare = self._spare[id(root)] = torch.empty_like(root)
        return spare.as_strided(view.shape, view.stride(), view.storage_offset())

    def commit(self, model: LlamaModel, staged: dict[str, torch.Tensor]) -> int:
        """Make the checked `staged` tensors live: swap the storages they fill entirely (when they
        were staged in the spare), copy the rest; repack what changed. Returns the bytes copied."""
        copied, changed = 0, set()
        with torch.no_grad():
            for root, names, whole in model.weight_storages():
                pushed = [n for n in names if n in staged]
                if not pushed:
                    continue
                changed.add(id(root))
                spare = self._spare.get(id(root)) if self._model is model else None
                if spare is not None and whole and len(pushed) == len(names) and all(
                        staged[n].data_ptr() == self._spare_of(model, model.hf_view(n)).data_ptr() for n in names):
                    _swap(root, spare)
                    continue
                for n in pushed:
                    model.hf_view(n).copy_(staged[n])
                    copied += staged[n].numel() * staged[n].element_size()
        model.weights_moved(changed)
        return copied


def _swap(live: torch.Tensor, spare: torch.Tensor) -> None:
    """Exchange the storages of two like tensors in place: every holder of `live` (the model's
    attributes, a tied head) sees the new values."""
    old = torch.empty(0, dtype=live.dtype, device=live.device).set_(live)
    live.set_(spare)
    spare.set_(old)
