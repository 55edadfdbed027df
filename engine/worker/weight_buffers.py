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

A trainer on the same machine can write into the spare itself (`lease`): the spare then lives
in shared memory, two segments per worker (`SpareSegments`, every storage with a slot in each),
and each storage's spare is kept in the segment its live tensor is not in, so a swap alternates
them. The trainer copies its tensors straight into the engine's spare (cast in that copy) while
generation goes on, and the update only checks the lease and swaps: one copy in all, where
sharing a segment of the trainer's own costs a copy into it and another out of it. A lease is
the right to write the spare until the next update stages it; while one is out, other updates
stage into fresh memory (they must not write what the trainer is writing).

Where a projection's matmul reads only its packed panels (Linear.panels_serve) and the trainer
can run the same pack (it names the kernels' pack functions it has: `layouts`), the lease hands
out a spare of the panels instead, and the trainer packs its tensors straight into it: the
update swaps the panels in and repacks nothing (a repack cost about a copy of the weights), and
the plain weights are unpacked from the live panels only if something reads them
(LlamaModel.panels_written). Each tensor of such a storage must fill whole panels (its rows
start and end at multiples of 32, but for the storage's last, whose pack pads it; k even for the
k-paired layout), or the storage is leased plain. A tied embedding is such a storage too: the LM
head's panels are all the trainer writes of it, and the model reads the embedding's rows out of
them until something reads the plain weights (a copy of the embedding, and the head's repack,
saved).

An update the engine receives itself (a broadcast, a checkpoint, tensors handed over) is packed
the same way where no lease is out: each such tensor goes from the receiver's buffer straight
into the spare of its linear's panels (`write`, the same pass a plain copy would cost), so its
pause holds the swap alone and no repack. That spare of the panels costs one more copy of those
weights in memory; the plain spare is then written only by a large tensor's pieces on the way in.

On CUDA, allocation is cheap and memory is scarce: tensors are staged into fresh memory and
copied in (no spare).
"""
from __future__ import annotations

import os
import secrets
import time
import weakref
from dataclasses import dataclass

import torch

from engine.errors import EngineStateError, InvalidRequestError
from engine.model.decoder import Linear, LlamaModel
from weight_sync.ipc import SHM_DIR
SEGMENT_PREFIX = "rollout-spare-"  # + "<pid>-<random>-<0|1>": a dead pid's segments are removed
ALIGN = 64
# A lease not used for this long is taken to be abandoned (its trainer died mid-push): another
# trainer may take the spare over. The first holder's update is then refused, never mixed in.
LEASE_TTL_S = 120.0
_NAMED: set[str] = set()  # this process's segments that still have names (see remove_segments)


@dataclass
class Lease:
    token: str
    holder: str
    since: float
    packed: frozenset[int] = frozenset()  # the storages (ids) whose panels the trainer writes


@dataclass
class _Storage:
    """One weight storage as a lease describes it: the plain tensors in it (`entries`, offsets in
    bytes from the storage's start) and, where its linear's panels alone serve the matmul and
    every tensor fills whole panels, that linear and each tensor's panels (`panel_rows`: name ->
    (first panel, panels))."""

    root: torch.Tensor
    entries: list[dict]
    linear: Linear | None
    panel_rows: dict[str, tuple[int, int]]


class WeightBuffers:
    """A worker's staging memory for base-weight updates (one per worker; see the module doc)."""

    def __init__(self):
        self._model: LlamaModel | None = None
        self._spare: dict[int, torch.Tensor] = {}  # id(root storage tensor) -> its spare
        self._panel_spare: dict[int, torch.Tensor] = {}  # id(root) -> a spare of its linear's panels (leased)
        self._segments: SpareSegments | None = None  # where the spare lives once a trainer leased it
        self._lease: Lease | None = None
        # a lease's table, but for the segment each storage's spare is in (the layout is the model's:
        # made once, as a lease is asked for at every push and building it anew cost several ms)
        self._layout: list[_Storage] | None = None
        self._storage_of: dict[str, _Storage] = {}  # each name of the layout -> its storage

    def release(self) -> None:
        """Drop the spare (sleep; a model that is replaced) and end any lease. Shared segments lose
        their names now and their memory with the last tensor in them."""
        self._model, self._spare, self._panel_spare, self._lease, self._layout = None, {}, {}, None, None
        self._storage_of = {}
        if self._segments is not None:
            self._segments.unlink()
            self._segments = None

    def dest(self, model: LlamaModel, name: str) -> torch.Tensor:
        """Where an update writes the tensor `name` (this rank's part of it): its view in the
        spare, or a fresh tensor (CUDA; while a trainer holds the spare's lease; a tied model's
        lm_head.weight, compared, then dropped)."""
        view = model.hf_view(model.embed_name if name == "lm_head.weight" and model.ties_head else name, current=False)
        usable = self._lease is None and (name != "lm_head.weight" or not model.ties_head)
        spare = self._spare_of(model, view) if usable else None
        return spare if spare is not None else torch.empty_like(view)

    def write(self, model: LlamaModel, name: str, t: torch.Tensor) -> torch.Tensor | None:
        """Stage the received tensor `name` (this rank's part of it, in the model's dtype or
        float32 for a bf16 model: cast on the way) packed into the spare of its linear's panels,
        where every step reads those panels alone, and return that view (the update then swaps the
        panels in: see the module doc); None where it is staged plain (`dest`): no such linear, a
        lease out, another device or dtype. A tensor-parallel rank's part of a row-parallel weight
        is a column slice of the received tensor: the pack reads it in place (rows apart by the
        full width), so no rank copies its share out first."""
        if self._lease is not None or model.device.type != "cpu":
            return None
        self._use(model)
        self._make_layout(model)
        st, ext = self._storage_of.get(name), model.ops.ext
        cast = t.dtype == torch.float32 and model.dtype == torch.bfloat16  # (a float32 checkpoint)
        rows_contiguous = t.dim() == 2 and t.stride(1) == 1  # (write_many packs rows apart by any stride)
        if st is None or st.linear is None or not (t.dtype == model.dtype or cast) or not rows_contiguous \
                or not hasattr(ext, "write_many"):
            return None
        panels, key = st.linear.panels, id(st.root)
        spare = self._panel_spare.get(key)
        if spare is None or spare.shape != panels.shape:
            spare = self._panel_spare[key] = torch.empty_like(panels)
        first, count = st.panel_rows[name]
        dst = spare.narrow(0, first, count)
        ext.write_many([t], [dst], [st.linear.pack_fn])  # (the trainer's SpareWriter runs the same)
        return dst

    def _make_layout(self, model: LlamaModel) -> None:
        if self._layout is None:
            self._layout = _layout(model)
            self._storage_of = {e["name"]: st for st in self._layout for e in st.entries}

    def _use(self, model: LlamaModel) -> None:
        if self._model is not model:
            self.release()
            self._model = model

    def _spare_of(self, model: LlamaModel, view: torch.Tensor) -> torch.Tensor | None:
        if model.device.type != "cpu":
            return None
        self._use(model)
        root = view._base if view._base is not None else view
        spare = self._spare.get(id(root))
        if spare is None:
            if not root.is_contiguous():
                return None
            spare = self._spare[id(root)] = torch.empty_like(root)
        # (a swapped-in root may sit at an offset in a shared segment: offsets are taken relative)
        return spare.as_strided(view.shape, view.stride(),
                                spare.storage_offset() + view.storage_offset() - root.storage_offset())

    def lease(self, model: LlamaModel, holder: str, layouts: tuple[str, ...] = ()) -> dict:
        """The right for `holder` (a trainer) to write the spare until its update stages it, and
        where: {"lease": token, "segments": [shared-memory names], "tensors": [{"name", "dtype",
        "shape", "stride", "segment", "offset" (bytes)}], "tied": {pushed name: the name it is
        checked against and dropped for}}; a tensor-parallel rank's entries carry the full tensor's
        shape and the "slice" it holds (_as_pushed). `layouts`: the pack functions of the kernels
        the trainer can run (kernels.cpu_ext; e.g. "bf16_vnni_pack"): a tensor whose storage takes one of them
        comes as {"name", "dtype", "shape", "pack": function, "packed_shape", "segment", "offset"},
        to be packed there (the module's doc). The same holder may lease again (a retry); another
        is refused (EngineStateError) while a lease younger than LEASE_TTL_S is out."""
        now = time.monotonic()
        if self._lease is not None and self._lease.holder != holder and now - self._lease.since < LEASE_TTL_S:
            raise EngineStateError(f"another trainer holds the weight spare (leased {now - self._lease.since:.0f} s "
                                   f"ago): push through a segment of your own", "spare")
        self._use(model)
        self._make_layout(model)
        if self._segments is None:
            slots = [list(_slots(st)) for st in self._layout]
            self._segments = SpareSegments(dict(kv for s in slots for kv in s),
                                           need=sum(max(n for _, n in s) for s in slots))
        segments, tensors, packed = self._segments, [], set()
        for st in self._layout:
            lin, key = st.linear, id(st.root)
            if lin is not None and lin.panels is not None and lin.pack_fn in layouts:
                panels = lin.panels
                spare = self._panel_spare[key] = self._slot_beside(self._panel_spare.get(key), panels, ("panels", key))
                where, start = segments.index_of(spare), segments.offset(("panels", key))
                step = panels[0].numel() * panels.element_size()  # bytes a panel
                for e in st.entries:
                    first, count = st.panel_rows[e["name"]]
                    tensors.append(_as_pushed(model, {"name": e["name"], "dtype": e["dtype"], "shape": e["shape"],
                                                      "pack": lin.pack_fn, "packed_shape": [count, *panels.shape[1:]],
                                                      "segment": where, "offset": start + first * step}))
                packed.add(key)
                continue
            spare = self._spare[key] = self._slot_beside(self._spare.get(key), st.root, key)
            where, start = segments.index_of(spare), segments.offset(key)
            tensors += [_as_pushed(model, dict(e, segment=where, offset=start + e["offset"])) for e in st.entries]
        self._lease = Lease(secrets.token_hex(8), holder, now, frozenset(packed))
        tied = {"lm_head.weight": model.embed_name} if model.ties_head else {}
        return {"lease": self._lease.token, "segments": segments.names, "tensors": tensors, "tied": tied}

    def _slot_beside(self, spare: torch.Tensor | None, live: torch.Tensor, key) -> torch.Tensor:
        """`spare` if it is a slot of a segment `live` is not in, else `key`'s slot in the other one
        (a swap alternates the two)."""
        segments = self._segments
        live_in = segments.index_of(live)
        where = None if spare is None else segments.index_of(spare)
        if where is None or where == live_in:
            spare = segments.slot(1 if live_in == 0 else 0, key, live)
        return spare

    def leased(self, model: LlamaModel, handles: dict) -> dict[str, torch.Tensor]:
        """An update the lease holder wrote into the spare ({"kind": "spare", "lease", "tensors":
        [names]}): the spare's views of those tensors (of their panels, where it packed them), to
        be committed like any staged update. The lease ends here, used or refused."""
        lease, self._lease = self._lease, None
        if lease is None or handles.get("lease") != lease.token or self._model is not model:
            raise InvalidRequestError("the weight spare's lease is not current (another trainer took it over, or the "
                                      "engine slept or staged another update since): lease it again", "lease")
        names = handles.get("tensors")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
            raise InvalidRequestError('a spare update names its tensors once each: {"tensors": [names]}', "handles")
        staged = {}
        for name in names:
            st = self._storage_of.get(name)  # (a current lease has made the layout)
            if st is None:
                raise InvalidRequestError(f"the weight spare has no tensor {name!r}", "handles")
            if id(st.root) in lease.packed:
                staged[name] = self._panels_of(st, name)
            else:
                staged[name] = self._spare_of(model, model.hf_view(name, current=False))
        return staged

    def _panels_of(self, st: _Storage, name: str) -> torch.Tensor:
        first, count = st.panel_rows[name]
        return self._panel_spare[id(st.root)].narrow(0, first, count)

    def commit(self, model: LlamaModel, staged: dict[str, torch.Tensor]) -> int:
        """Make the checked `staged` tensors live: swap the storages they fill entirely (when they
        were staged in the spare), copy the rest; repack what changed. Returns the bytes copied."""
        copied, changed, packed = 0, set(), []
        storages = {id(st.root): st for st in self._layout or ()} if self._model is model else {}
        with torch.no_grad():
            for root, names, whole in model.weight_storages():
                pushed = [n for n in names if n in staged]
                if not pushed:
                    continue
                st = storages.get(id(root))
                if st is not None and id(root) in self._panel_spare and all(
                        _same(staged[n], self._panels_of(st, n)) for n in pushed):  # the trainer wrote panels
                    if len(pushed) == len(names):
                        _swap(st.linear.panels, self._panel_spare[id(root)])
                    else:
                        for n in pushed:
                            first, count = st.panel_rows[n]
                            st.linear.panels.narrow(0, first, count).copy_(staged[n])
                            copied += staged[n].numel() * staged[n].element_size()
                    packed.append(st.linear)
                    continue
                changed.add(id(root))
                spare = self._spare.get(id(root)) if self._model is model else None
                if spare is not None and whole and len(pushed) == len(names) and all(
                        _same(staged[n], self._spare_of(model, model.hf_view(n, current=False))) for n in names):
                    _swap(root, spare)
                    continue
                for n in pushed:
                    model.hf_view(n).copy_(staged[n])
                    copied += staged[n].numel() * staged[n].element_size()
        model.weights_moved(changed)
        model.panels_written(packed)
        return copied


class SpareSegments:
    """Two shared-memory files under /dev/shm with a slot of the given bytes for every key in each
    (a weight storage, a linear's panels: a live tensor and its spare are never in the same one).
    Files are created sparse: a slot costs memory once written, and /dev/shm must hold `need`
    bytes of each (what one update's slots take: a storage's plain tensor or its panels). The
    names go when the worker releases them or exits (and a dead process's are removed by the next
    worker that makes some); the memory goes with the last tensor that uses it."""

    def __init__(self, slots: dict[object, int], need: int):
        if not os.path.isdir(SHM_DIR):
            raise InvalidRequestError(f"no {SHM_DIR} here: the weight spare cannot be shared", "spare")
        self._offsets, size = {}, 0
        for key, nbytes in slots.items():
            self._offsets[key] = size
            size += (nbytes + ALIGN - 1) // ALIGN * ALIGN
        free = os.statvfs(SHM_DIR)
        if free.f_bavail * free.f_frsize < 2 * need:  # writing past a full tmpfs is a SIGBUS
            raise InvalidRequestError(f"{SHM_DIR} has {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free, the "
                                      f"weight spare needs {2 * need / 2**20:.0f} MiB", "spare")
        _remove_dead_segments()
        stem = f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self.names = [stem + "0", stem + "1"]
        self._storages = [_create(name, size) for name in self.names]
        self._index = {storage.data_ptr(): i for i, storage in enumerate(self._storages)}
        _NAMED.update(self.names)
        self._unlink = weakref.finalize(self, _unlink_all, list(self.names))

    def unlink(self) -> None:
        self._unlink()

    def base(self, index: int) -> int:
        return self._storages[index].data_ptr()

    def index_of(self, t: torch.Tensor) -> int | None:
        """Which segment holds `t` (None: ordinary memory)."""
        return self._index.get(t.untyped_storage().data_ptr())

    def offset(self, key) -> int:
        """Where `key`'s slot starts in each segment (bytes)."""
        return self._offsets[key]

    def slot(self, index: int, key, like: torch.Tensor) -> torch.Tensor:
        """`key`'s slot in segment `index`, a tensor laid out like `like`."""
        offset = self._offsets[key]
        return torch.empty(0, dtype=like.dtype).set_(self._storages[index], offset // like.element_size(),
                                                      like.shape, like.stride())


def _create(name: str, size: int) -> torch.UntypedStorage:
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(size, 1))
    finally:
        os.close(fd)
    return torch.UntypedStorage.from_file(os.path.join(SHM_DIR, name), shared=True, nbytes=max(size, 1))


def _unlink_all(names: list[str]) -> None:
    for name in names:
        _NAMED.discard(name)
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass


def remove_segments() -> None:
    """Take the names of this process's segments back: for an exit that skips finalizers (the
    engine core's os._exit on SIGTERM), or tmpfs would keep their memory until another worker
    starts."""
    _unlink_all(list(_NAMED))


def _remove_dead_segments() -> None:
    """Segments whose worker died without unlinking them (killed): their pid is gone."""
    for name in os.listdir(SHM_DIR):
        if not name.startswith(SEGMENT_PREFIX):
            continue
        try:
            pid = int(name[len(SEGMENT_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue
        except ProcessLookupError:
            _unlink_all([name])
        except PermissionError:  # another user's live process
            pass


def _layout(model: LlamaModel) -> list[_Storage]:
    from weight_sync.protocol import dtype_name  # (the trainer's SpareWriter reads the same names)

    linears = {id(lin.weight): lin for lin in model._linears() if lin.panels_serve()}  # (a tied head's: the embedding)
    layout = []
    for root, names, _ in model.weight_storages():
        entries, panel_rows = [], {}
        lin = linears.get(id(root))
        for name in names:
            view = model.hf_view(name, current=False)
            offset = view.storage_offset() - root.storage_offset()
            entries.append({"name": name, "dtype": dtype_name(view.dtype), "shape": list(view.shape),
                            "stride": list(view.stride()), "offset": offset * view.element_size()})
            if lin is not None:  # (a 2-d storage, its tensors whole rows of it)
                row, rows, k = offset // root.shape[1], view.shape[0], root.shape[1]
                whole = rows % 32 == 0 or row + rows == root.shape[0]  # (the storage's last panel: padded by the pack)
                if row % 32 == 0 and whole and rows and (lin.pack_fn != "bf16_vnni_pack" or k % 2 == 0):
                    panel_rows[name] = (row // 32, (rows + 31) // 32)
        layout.append(_Storage(root, entries, lin if lin is not None and len(panel_rows) == len(names) else None,
                               panel_rows))
    return layout


def _as_pushed(model: LlamaModel, entry: dict) -> dict:
    """A lease's entry as the trainer sees it: "shape" that of the full tensor it pushes, and where
    this rank holds a slice of it (tensor parallelism) "slice": [dim, start, count], the part the
    slot takes (its "stride" and "packed_shape" are the slice's)."""
    shard = model.hf_shard(entry["name"])
    if shard.dim is None:
        return entry
    start, count = shard.ranges[model.part.rank]
    return dict(entry, shape=list(shard.full_shape(tuple(entry["shape"]))), slice=[shard.dim, start, count])


def _slots(st: _Storage):
    """A storage's slots in the spare's segments: its plain tensor, and its linear's panels."""
    yield id(st.root), st.root.numel() * st.root.element_size()
    if st.linear is not None:
        yield ("panels", id(st.root)), st.linear.panels.numel() * st.linear.panels.element_size()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` is the view `b` (a staged tensor written where the spare holds it)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _swap(live: torch.Tensor, spare: torch.Tensor) -> None:
    """Exchange the storages of two like tensors in place: every holder of `live` (the model's
    attributes, a tied head) sees the new values."""
    old = torch.empty(0, dtype=live.dtype, device=live.device).set_(live)
    live.set_(spare)
    spare.set_(old)
