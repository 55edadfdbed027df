"""The LoRA adapters an engine core serves: one registry, owned by the EngineCore.

It knows every adapter registered (add_lora .. remove_lora): name, folder, the version its tokens
carry, whether its weights came from a push, whether it is pinned. The scheduler reads `pinned`
(a pinned adapter keeps its slot); the worker only caches the resident adapters' tensors
(engine/worker/lora.py) and evicts the least recently used one that the core's `keep` set
(pinned or used by a request) does not name.
"""
from dataclasses import dataclass


@dataclass
class LoRAEntry:
    name: str
    path: str  # its PEFT folder (a disk push replaces it)
    version: int = 0  # the version of its weights; pushes set it, a re-registration with other weights bumps it
    pushed: bool = False  # its weights came from a push: they exist nowhere else (so it is pinned)
    registered: bool = True  # False after remove_lora (the id's version history is kept)


class LoRARegistry:
    def __init__(self):
        self.entries: dict[int, LoRAEntry] = {}  # every id ever registered
        self.pinned: set[int] = set()  # ids that keep a slot (pin_lora, and every pushed adapter)

    def registered(self) -> dict[int, LoRAEntry]:
        return {i: e for i, e in self.entries.items() if e.registered}

    def is_registered(self, lora_id: int) -> bool:
        entry = self.entries.get(lora_id)
        return entry is not None and entry.registered

    def get(self, lora_id: int) -> LoRAEntry:
        return self.entries[lora_id]

    def version(self, lora_id: int) -> int | None:
        entry = self.entries.get(lora_id)
        return None if entry is None else entry.version

    def register(self, lora_id: int, name: str, path: str) -> bool:
        """Register (again); True when the id now names other weights than it last did (another
        folder, or pushed weights before): a new version, and its cached KV must go."""
        old = self.entries.get(lora_id)
        if old is None:
            self.entries[lora_id] = LoRAEntry(name, path)
            return False
        changed = old.path != path or old.pushed
        self.entries[lora_id] = LoRAEntry(name, path, old.version + changed)
        return changed

    def unregister(self, lora_id: int) -> None:
        self.entries[lora_id].registered = False
        self.pinned.discard(lora_id)

    def pushed(self, lora_id: int, version: int, path: str | None) -> None:
        """New weights went live for it (a push, or a disk update from `path`); they exist nowhere
        else, so it stays resident (pinned)."""
        entry = self.entries[lora_id]
        entry.version, entry.pushed = int(version), True
        if path is not None:
            entry.path = path
        self.pinned.add(lora_id)
