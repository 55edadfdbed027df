"""Weights handed to an engine on the same machine without a network copy.

The trainer shares its tensors (`SharedWeights`), passes the small, JSON-able handle dict to the
engine (`LLM.update_weights_from_ipc`), and keeps the tensors alive until the call returns; the
engine reads the handles (`read_shared`), checks names, shapes and dtypes like any push before
anything is copied, and swaps the copies into its weights atomically.

- CUDA tensors: CUDA IPC memory handles (torch.multiprocessing's reductions), for a trainer
  and an engine sharing a GPU: the engine reads the trainer's memory in place, no host copy.
  The handle is a pickle of torch's rebuild call; the engine unpickles it with an allow-list of
  torch's own rebuild functions and types, so a handle can never run other code.
- CPU tensors: one POSIX shared-memory segment holding them all (one copy on the trainer's side,
  one into the weights), named in the handles with each tensor's offset, dtype and shape.

Handles: {"kind": "cuda" | "shm", "tensors": [...], "shm": name (shm only)}, or {"kind": "spare",
"lease", "tensors": [names]} for tensors a `SpareWriter` wrote into the engine's own staging memory
(lent by LLM.lease_weight_spare: one copy in all, where a segment of the trainer's costs two);
{"kind": "spare", "ranks": [{"lease", "tensors"}, ...]} for a replica of several tensor-parallel
ranks, each of which lent its own spare for its slices.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import functools
import io
import math
import mmap
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator
from multiprocessing import shared_memory

import torch
from typing_extensions import Self

from weight_sync.protocol import dtype_name, parse_dtype

ALIGN = 64
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux
# the kernels' packs a SpareWriter runs (kernels/csrc: vnni_linear.cpp, f32_linear.cpp); the engine
# names the one its projections were packed with in a lease's tensors
PACK_FUNCTIONS = ("bf16_vnni_pack", "f32_panel_pack", "bf16_panel_pack")

# The globals a CUDA IPC handle may name: torch's rebuild function for a (detached) CUDA tensor
# and the types its arguments carry (the dtype is checked in find_class).
_ALLOWED = {
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch.storage", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and parse_dtype(name) is not None:
            return parse_dtype(name)
        raise pickle.UnpicklingError(f"a CUDA IPC handle may not name {module}.{name}")


def _dump_cuda(t: torch.Tensor) -> str:
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(t)
    return base64.b64encode(buf.getvalue()).decode()


def _load_cuda(handle: str) -> torch.Tensor:
    try:
        t = _HandleUnpickler(io.BytesIO(base64.b64decode(handle))).load()
    except (pickle.UnpicklingError, EOFError, binascii.Error) as e:
        raise ValueError(f"bad CUDA IPC handle: {e}") from None
    if not isinstance(t, torch.Tensor):  # the handle's content is wrong, not an argument's type: a
        # bad push, refused as every bad push is (ValueError -> the caller's 400)
        raise ValueError("a CUDA IPC handle must hold one tensor")  # noqa: TRY004
    return t


@functools.cache
def host_key() -> str | None:
    """Names this machine's shared memory: processes with the same key open each other's
    /dev/shm segments (one boot of one kernel, one tmpfs mount: containers with a /dev/shm of
    their own differ). None where there is no /dev/shm. Fixed for a process's life: read once."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(SHM_DIR)
    except OSError:
        return None
    return f"{boot}:{st.st_dev}:{st.st_ino}"


class SharedWeights:
    """The trainer's side: `handles = shared.share(named_tensors)`; keep `shared` open until the
    engine's update returned, then share the next push through the same object (its segment is
    reused when the names, shapes and dtypes repeat: fresh shared memory costs page faults worth
    several copies) and `close()` it at the end (or use it as a context manager). After an
    update that failed or timed out, call `close()` before sharing again: the engine may still
    be reading the segment."""

    def __init__(self):
        self._shm: shared_memory.SharedMemory | None = None
        self._metas: list[dict] = []
        self._keep: list[torch.Tensor] = []

    def share(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> dict:
        """Handles for the engine. `dtype`: floating-point tensors are cast to it (in the copy
        into shared memory, CPU tensors; CUDA tensors are cast first)."""
        self._keep = []
        named = [(n, t.detach()) for n, t in named_tensors]
        if not named:
            raise ValueError("nothing to share")
        kinds = {t.device.type for _, t in named}
        if kinds == {"cuda"}:
            self.close()
            self._keep = [_cast(t, dtype) for _, t in named]
            return {"kind": "cuda", "tensors": [{"name": n, "handle": _dump_cuda(t)}
                                                for (n, _), t in zip(named, self._keep)]}
        if kinds != {"cpu"}:
            raise ValueError(f"tensors must be all CUDA or all CPU, got {sorted(kinds)}")
        metas, offset = [], 0
        for n, t in named:
            out = dtype if dtype is not None and t.is_floating_point() else t.dtype
            metas.append({"name": n, "dtype": dtype_name(out), "shape": list(t.shape), "offset": offset})
            offset += (t.numel() * out.itemsize + ALIGN - 1) // ALIGN * ALIGN
        if metas != self._metas:
            self.close()
            self._shm = shared_memory.SharedMemory(create=True, size=max(offset, 1))
            self._metas = metas
        for (_, t), m in zip(named, metas):
            dst = torch.frombuffer(self._shm.buf, dtype=parse_dtype(m["dtype"]), count=t.numel(),
                                   offset=m["offset"]) if t.numel() else None
            if dst is not None:
                dst.view(t.shape).copy_(t)
            del dst  # no view may outlive the segment
        return {"kind": "shm", "shm": self._shm.name, "tensors": metas}

    def close(self) -> None:
        self._keep, self._metas = [], []
        if self._shm is not None:
            shm, self._shm = self._shm, None
            shm.close()
            shm.unlink()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # at interpreter shutdown the modules close() uses may be gone
            self.close()


class SpareWriter:
    """The trainer's side of a leased spare (engine/worker/weight_buffers.py): `write(lease,
    named_tensors)` copies the tensors straight into the engine's staging memory (cast to its
    dtype in that copy; for a replica of tensor-parallel ranks, each rank's slices into the spare
    that rank lent) and returns the handles for update_weights_from_ipc, or None, having
    written nothing, when the push does not fit the lease (a name twice, a name or shape it has
    no slot for, a tensor not floating point or not on the CPU, another dtype asked for, a tied
    head that differs, an engine on another machine whose segments are not here): push it
    another way then, which refuses what is wrong with the engine's own message. Keeps the
    engine's segments mapped between pushes; `close()` unmaps them.

    `layouts`: the engine kernels' pack functions this process can run (the C++ CPU kernels
    compiled on this machine already; none otherwise), to be named in the lease request: the
    engine then hands out its matmul's packed panels where it can, and `write` packs into them,
    which spares the engine a repack of what it receives."""

    def __init__(self):
        self._mapped: dict[str, _Attached] = {}
        self._scratch: torch.Tensor | None = None  # a cast before a pack, reused (fresh pages fault)

    @functools.cached_property
    def layouts(self) -> list[str]:
        ext = self._kernels()
        return [] if ext is None else [f for f in PACK_FUNCTIONS if hasattr(ext, f)]

    def write(self, lease: dict, named_tensors: Iterable[tuple[str, torch.Tensor]],
              dtype: torch.dtype | None = None) -> dict | None:
        pairs = [(n, t.detach()) for n, t in named_tensors]
        named = dict(pairs)
        parts = lease.get("ranks", [lease])  # (a replica of several tensor-parallel ranks: a lease each)
        tied = parts[0].get("tied", {})  # (dropped by the engine after checking they are the embedding)
        if len(named) != len(pairs) or any(to not in named or not _same_values(named[n], named[to])
                                           for n, to in tied.items() if n in named):
            return None
        if not all(self._fits(part, named, dtype) for part in parts):
            return None
        wanted = [name for part in parts for name in part["segments"]]
        try:
            segments = {name: self._map(name) for name in wanted}
        except ValueError:  # not this machine's shared memory (the engine runs elsewhere)
            return None
        for name in list(self._mapped):
            if name not in segments:
                self._mapped.pop(name).close()
        batch = _Batch(self._kernels())  # (every write of every rank: one call of the kernels)
        try:
            written = [self._write_part(batch, [segments[n] for n in part["segments"]], part, named)
                       for part in parts]
            batch.run()
        finally:
            batch.views.clear()  # no view may outlive the mapping
        handles = [{"lease": part["lease"], "tensors": names} for part, names in zip(parts, written)]
        return {"kind": "spare", "ranks": handles} if "ranks" in lease else dict(handles[0], kind="spare")

    def _fits(self, lease: dict, named: dict[str, torch.Tensor], dtype: torch.dtype | None) -> bool:
        slots, tied = {m["name"]: m for m in lease["tensors"]}, lease.get("tied", {})
        for name, t in named.items():
            if name in tied:
                continue
            slot = slots.get(name)
            if slot is None or t.device.type != "cpu" or not t.is_floating_point() or list(t.shape) != slot["shape"] \
                    or (dtype is not None and dtype_name(dtype) != slot["dtype"]) \
                    or ("pack" in slot and slot["pack"] not in self.layouts):
                return False
        return True

    def _write_part(self, batch: _Batch, segments: list[_Attached], lease: dict,
                    named: dict[str, torch.Tensor]) -> list[str]:
        """Queue (or make) the writes of one lease's slots; the names written."""
        slots = {m["name"]: m for m in lease["tensors"]}
        written = []
        for name, t in named.items():
            slot = slots.get(name)
            if slot is None:
                continue
            if "slice" in slot:  # (a tensor-parallel rank's part of the full tensor)
                t = t.narrow(*slot["slice"])
            d = parse_dtype(slot["dtype"])
            buf = segments[slot["segment"]].buf
            if "pack" in slot:  # (a slot of the engine's panels: the pack writes it whole, pads included)
                self._pack(batch, buf, slot, t, d)
            elif t.numel():
                dst = torch.frombuffer(buf, dtype=d, offset=slot["offset"],
                                       count=1 + sum((n - 1) * st for n, st in zip(t.shape, slot["stride"])))
                dst = dst.as_strided(t.shape, slot["stride"])
                if not batch.copy(t, dst):
                    dst.copy_(t)
                del dst
            written.append(name)
        return written

    def _pack(self, batch: _Batch, buf, slot: dict, t: torch.Tensor, dtype: torch.dtype) -> None:
        """The engine's pack `slot["pack"]` of `t` (cast to `dtype`) into the slot's panels (of
        shape "packed_shape"): batched, or at once where it needs the cast's scratch memory."""
        dst = torch.frombuffer(buf, dtype=dtype, count=math.prod(slot["packed_shape"]),
                               offset=slot["offset"]).view(slot["packed_shape"])
        if not batch.pack(t, dst, slot["pack"]):
            getattr(self._kernels(), slot["pack"])(self._cast(t, dtype), dst)
        del dst

    @staticmethod
    def _kernels():
        from kernels import cpu_ext

        return cpu_ext.built()

    def _cast(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`t` contiguous in `dtype`, for the pack: itself, or a copy in reused scratch memory."""
        if t.dtype == dtype and t.is_contiguous():
            return t
        nbytes = t.numel() * dtype.itemsize
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        return self._scratch[:nbytes].view(dtype).view(t.shape).copy_(t)

    def _map(self, name: str) -> _Attached:
        if name not in self._mapped:
            self._mapped[name] = _Attached(name)
        return self._mapped[name]

    def close(self) -> None:
        for shm in self._mapped.values():
            shm.close()
        self._mapped = {}


class _Batch:
    """A push's packs and copies (same dtype, or float32 cast to bfloat16 on the way), run as one
    call of the kernels' write_many (the threads share out all the bytes; streamed stores), or not
    taken where it is not built."""

    def __init__(self, ext):
        self.ext = ext if ext is not None and hasattr(ext, "write_many") else None
        self.srcs, self.views, self.packs = [], [], []

    def pack(self, t: torch.Tensor, dst: torch.Tensor, pack: str) -> bool:
        return self._add(t, dst, pack)

    def copy(self, t: torch.Tensor, dst: torch.Tensor) -> bool:
        return dst.is_contiguous() and self._add(t, dst.view(-1), "")

    def _add(self, t: torch.Tensor, dst: torch.Tensor, pack: str) -> bool:
        cast = t.dtype == torch.float32 and dst.dtype == torch.bfloat16  # (float32 masters into a bf16 engine)
        # a pack reads rows at any stride (a tensor-parallel rank's column slice), a copy whole tensors
        readable = t.dim() == 2 and (t.stride(1) == 1 or t.size(1) <= 1) if pack else t.is_contiguous()
        if self.ext is None or not (t.dtype == dst.dtype or cast) or not readable:
            return False
        self.srcs.append(t if pack else t.view(-1))
        self.views.append(dst)
        self.packs.append(pack)
        return True

    def run(self) -> None:
        if self.srcs:
            self.ext.write_many(self.srcs, self.views, self.packs)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, without reading the bytes of two views of the same memory (a trainer's tied
    lm_head and embedding)."""
    same = a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
    return same or torch.equal(a, b)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def read_shared(handles: dict, device: torch.device, check: Callable | None = None,
                select: Callable | None = None,
                stage: Callable[[str, torch.Tensor], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The engine's side: copies on `device` of the tensors behind the handles. `check(name,
    shape, dtype)` runs for every tensor before anything is copied (raise to refuse the push);
    `select(name, tensor)`: the part of each to copy (a tensor-parallel rank's slice); `stage(name,
    part)`: copies it where the caller stages it and returns that (fresh tensors without it)."""
    if not isinstance(handles, dict) or handles.get("kind") not in ("cuda", "shm") \
            or not isinstance(handles.get("tensors"), list):
        raise ValueError('IPC handles must be {"kind": "cuda" | "shm", "tensors": [...]} (from SharedWeights)')
    if handles["kind"] == "cuda":
        named = [(m["name"], _load_cuda(m["handle"])) for m in handles["tensors"]]
        return _checked_copies(named, device, check, select, stage)
    with _kept_lock:
        shm = _mapped(str(handles.get("shm")))
        named = []
        try:
            named = list(_views(shm, handles["tensors"]))
            return _checked_copies(named, device, check, select, stage)
        finally:
            del named  # no view may outlive the mapping
            if shm is not _kept:
                shm.close()


# The segment read last stays mapped in the reader: a trainer that refills its segment push after
# push (SharedWeights does) is then read through page tables already in place, where attaching
# anew costs about as much as a copy of it. At most one is kept; it is dropped as soon as a read
# names another segment or finds its name gone (the trainer closed it), and by forget_shared().
_kept: _Attached | None = None
_kept_lock = threading.Lock()


def _mapped(name: str) -> _Attached:
    global _kept
    if _kept is not None and (_kept.name != name.lstrip("/") or not _still_named(_kept.name)):
        _forget()
    if _kept is not None:
        return _kept
    shm = _Attached(name)
    if _still_named(shm.name):  # (where /dev/shm cannot be checked, nothing is kept)
        _kept = shm
    return shm


def _still_named(name: str) -> bool:
    return os.path.exists(f"{SHM_DIR}/{name}")


def _forget() -> None:
    global _kept
    shm, _kept = _kept, None
    if shm is not None:
        try:
            shm.close()
        except BufferError:  # a view still exported: the mapping goes with its last reference
            pass


def forget_shared() -> None:
    """Unmap the segment kept from the last read (a sleeping engine keeps nothing it does not need)."""
    with _kept_lock:
        _forget()


def _checked_copies(named, device, check, select=None, stage=None) -> dict[str, torch.Tensor]:
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice in the handles")
    if check is not None:
        for n, t in named:
            check(n, tuple(t.shape), t.dtype)
    out = {}
    for n, t in named:
        part = t if select is None else select(n, t)
        out[n] = part.to(device, copy=True) if stage is None else stage(n, part)
    return out


class _Attached:
    """A segment mapped by name, as SharedMemory(name, create=False) maps it but without
    multiprocessing's resource tracker: attaching through it starts a tracker process in this
    one (a trainer that only writes an engine's spare would carry a helper process for its
    life) and, before Python 3.13, unlinks the other process's segment at exit."""

    def __init__(self, name: str):
        self.name = name.lstrip("/")
        if not self.name or "/" in self.name or "\0" in self.name or self.name in (".", ".."):
            raise ValueError(f"{name!r} is not a shared-memory segment name")
        try:
            fd = os.open(f"{SHM_DIR}/{self.name}", os.O_RDWR)
        except FileNotFoundError:
            raise ValueError(f"no shared-memory segment {name!r}: the trainer closed it too early") from None
        try:
            self.size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, self.size) if self.size else None
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap) if self._mmap is not None else memoryview(b"")

    def close(self) -> None:
        """Unmap (BufferError while a tensor still views it: the mapping then goes with the last one)."""
        self.buf.release()
        if self._mmap is not None:
            self._mmap.close()


def _views(shm: _Attached, metas) -> Iterator[tuple[str, torch.Tensor]]:
    for m in metas:
        dtype = parse_dtype(str(m.get("dtype")))
        if dtype is None:
            raise ValueError(f"{m.get('name')}: unknown dtype {m.get('dtype')!r}")
        shape = [int(s) for s in m["shape"]]
        numel = math.prod(shape)
        offset = int(m["offset"])
        if offset < 0 or any(s < 0 for s in shape) or offset + numel * dtype.itemsize > shm.size:
            raise ValueError(f"{m['name']}: offset/shape outside the shared segment")
        t = torch.frombuffer(shm.buf, dtype=dtype, count=numel, offset=offset) if numel else torch.empty(0, dtype=dtype)
        yield str(m["name"]), t.view(shape)
