"""The weight-push wire protocol: one call per update, a fixed sequence of collectives.

    sender (rank 0)                                  receivers (ranks 1..N)
    1. broadcast int64[1] header length,
       then uint8[len] msgpack `PushHeader`          decode; check every (name, dtype, shape)
                                                     against the model's expectations
    2. all_reduce_max(status)      0 = all accept, 1 = a receiver refused, 2 = the sender aborted
       -> nonzero: everyone raises `WeightTransferError` here; nothing else was sent, the group
          stays in step and can carry the next push
    3. broadcast each bucket (uint8, <= bucket_bytes)  receive into a bucket buffer, then copy
       (packing the next one while it travels)       each tensor to where the caller stages it
                                                     (`into`; never the live weights), or keep
                                                     views into fresh buffers
    4. all_reduce_max(0)           confirms every receiver holds everything; only then does
                                                     `receive()` return the staged tensors

Buckets: tensors are grouped by dtype (in order of first appearance), metadata order within a
dtype, and packed back to back into 1-D byte buffers of at most `bucket_bytes`, each tensor at a
256-byte aligned offset (so the receiver's views are as aligned as fresh allocations for
vectorized kernels). A tensor larger than the cap is cut into cap-sized pieces received straight
into its destination, so the sender's staging buffers never exceed the cap. Both sides keep
PIPELINE_DEPTH buckets in flight and reuse their buffers from push to push: fresh memory costs
page faults worth several copies. A tensor that is
alone in its bucket (or piece) and already contiguous with the wire's dtype and device is sent
from its own storage, without a copy. The plan is a pure function of the header, so both sides
compute it and only the header crosses the wire. Buckets travel as bytes, so any dtype moves on
any backend (gloo has no float8, for instance).

Failure: a transport error (peer died, timeout) or an unexpected error mid-push breaks the group
(`WeightTransferGroup.abort`), so the peers fail at once too; open a new group to retry. A
receiver that raises returns nothing: the caller's live weights are untouched by construction.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from weight_sync.group import Pending, WeightPushRefused, WeightTransferError, WeightTransferGroup

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightReceiver", "WeightSender", "WeightTransferError"]

# Default cap per backend. gloo, 16 MiB: on loopback the push runs ~1.5-2x faster with 4-16 MiB
# buckets than with 64 MiB or more (the staging buffer stays cache-resident and the sender packs
# the next bucket while the receiver drains the last; benchmarks/weight_transfer.py). NCCL, 256 MiB
# (not measured here: it needs two GPUs): per-call launch and sync costs are fixed while
# NVLink moves 16 MiB in ~0.1 ms, so bigger buckets amortize them; two such staging buffers are
# all the extra GPU memory a push costs the trainer (see PIPELINE_DEPTH).
DEFAULT_BUCKET_BYTES = {"gloo": 16 << 20, "nccl": 256 << 20}
# ... and the most a gloo bucket holds whatever cap the client picked (a larger cap still bounds
# nothing more than the staging memory): one bucket of 64 MiB or more stops the pack and unpack
# from overlapping the transport and ran 1.5-2x slower than 16 MiB ones on loopback, while a
# network link gains nothing from it either (16 MiB take ~13 ms at 10 Gb/s, calls cost ~0.1 ms).
GLOO_MAX_BUCKET_BYTES = 16 << 20
ALIGN = 256  # byte alignment of every tensor inside a bucket
# Buckets in flight at once on each side: the sender packs one while the other travels, the
# receiver unpacks one while the next arrives (each side keeps that many bucket buffers).
PIPELINE_DEPTH = 2
MAX_HEADER_BYTES = 256 << 20  # ~100 bytes per tensor: millions of tensors fit

OK, REFUSED, SENDER_ABORTED = 0, 1, 2


class TensorMeta(msgspec.Struct, array_like=True, gc=False):
    name: str
    dtype: str  # torch dtype name without the "torch." prefix: "bfloat16"
    shape: list[int]


class PushHeader(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    tensors: list[TensorMeta]
    bucket_bytes: int
    error: str = ""  # the sender failed before sending any tensor: everyone stops at step 2


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(PushHeader).decode


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


@dataclass
class Bucket:
    """One broadcast: several small tensors packed together, or one piece of a large tensor."""

    dtype: str
    indices: list[int]  # into PushHeader.tensors
    offsets: list[int]  # byte offset of each tensor in the bucket
    nbytes: int
    piece_start: int = -1  # >= 0: this bucket is bytes [piece_start, piece_start + nbytes) of indices[0]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _nbytes(meta: TensorMeta) -> int:
    numel = 1
    for d in meta.shape:
        numel *= d
    return numel * parse_dtype(meta.dtype).itemsize


def plan_buckets(header: PushHeader) -> list[Bucket]:
    """The broadcasts of a push, the same on every rank (a pure function of the header).

    Tensors of one dtype (dtypes in order of first appearance, metadata order within one) are
    packed into buckets of at most `bucket_bytes`; a tensor larger than that is cut into pieces
    of that size (rounded down to ALIGN), so no broadcast and no staging buffer exceeds the cap."""
    cap = header.bucket_bytes
    piece = max(ALIGN, cap // ALIGN * ALIGN)
    by_dtype: dict[str, list[int]] = {}
    for i, m in enumerate(header.tensors):
        by_dtype.setdefault(m.dtype, []).append(i)
    buckets: list[Bucket] = []
    for dtype, indices in by_dtype.items():
        cur = None
        for i in indices:
            n = _nbytes(header.tensors[i])
            if n > cap:
                buckets.extend(Bucket(dtype, [i], [0], min(piece, n - a), a) for a in range(0, n, piece))
                continue
            offset = _align(cur.nbytes) if cur is not None else 0
            if cur is None or offset + n > cap:
                cur, offset = Bucket(dtype, [], [], 0), 0
                buckets.append(cur)
            cur.indices.append(i)
            cur.offsets.append(offset)
            cur.nbytes = offset + n
    return buckets


def check_header(header: PushHeader, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> str:
    """Why a receiver refuses this push ("" = it accepts). A subset of the expected names is fine."""
    problems = [] if header.bucket_bytes > 0 else [f"bucket_bytes must be positive, got {header.bucket_bytes}"]
    seen = set()
    for m in header.tensors:
        if m.name in seen:
            problems.append(f"duplicate tensor name {m.name!r}")
        seen.add(m.name)
        if m.name not in expected:
            problems.append(f"unknown tensor name {m.name!r} (not in the receiver's model)")
            continue
        shape, dtype = expected[m.name]
        if tuple(m.shape) != tuple(shape):
            problems.append(f"shape mismatch for {m.name!r}: got {tuple(m.shape)}, expected {tuple(shape)}")
        if m.dtype != dtype_name(dtype):
            problems.append(f"dtype mismatch for {m.name!r}: got {m.dtype}, expected {dtype_name(dtype)}")
    if not problems:
        return ""
    more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
    return f"{len(problems)} problem(s): " + "; ".join(problems[:5]) + more


class WeightSender:
    """Rank 0 of a `WeightTransferGroup`: pushes named tensors to every other rank.
    `bucket_bytes`: the most one broadcast, and each of the two staging buffers, holds (default
    DEFAULT_BUCKET_BYTES of the backend; over gloo at most GLOO_MAX_BUCKET_BYTES)."""

    def __init__(self, group: WeightTransferGroup, bucket_bytes: int | None = None):
        assert group.rank == 0, f"the sender is rank 0, this group member is rank {group.rank}"
        if bucket_bytes is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES[group.backend]
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.bucket_bytes = min(bucket_bytes, GLOO_MAX_BUCKET_BYTES) if group.backend == "gloo" else bucket_bytes
        self._buffers: list[torch.Tensor | None] = [None] * PIPELINE_DEPTH

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> dict:
        """Push all `named_tensors` (any device; cast to `dtype` first when given, floating-point
        tensors only, like `Module.to(dtype)`). Returns stats once every receiver confirmed
        holding everything; raises `WeightTransferError` if any receiver refused or failed."""
        t0 = time.perf_counter()
        tensors, header = self._collect(named_tensors, dtype)
        self._send_header(header)
        status = self.group.all_reduce_max(SENDER_ABORTED if header.error else OK)
        if header.error:
            raise WeightPushRefused(f"push aborted before sending anything: {header.error}")
        if status != OK:
            raise WeightPushRefused(
                "a receiver refused the push (names, shapes or dtypes do not match its model; the "
                "receiver's exception says which); nothing was sent"
            )
        buckets = [b for b in plan_buckets(header) if b.nbytes]
        try:
            self._broadcast_all(tensors, buckets)
        except WeightTransferError:
            raise
        except BaseException as e:  # the receivers wait for buckets we will not send: break the group
            self.group.abort(f"sender failed mid-push: {e!r}")
            raise WeightTransferError(f"sender failed mid-push, group aborted: {e!r}") from e
        if self.group.all_reduce_max(OK) != OK:
            raise WeightTransferError("a receiver failed to stage the push")
        num_bytes = sum(_nbytes(m) for m in header.tensors)
        seconds = time.perf_counter() - t0
        return {
            "num_tensors": len(tensors),
            "num_bytes": num_bytes,
            "num_buckets": len(buckets),
            "seconds": seconds,
            "gb_per_s": num_bytes / seconds / 1e9,
        }

    def _broadcast_all(self, tensors: list[torch.Tensor], buckets: list[Bucket]) -> None:
        """Every bucket, pipelined: the next one is packed (and cast) while the backend's threads
        still send the last, so packing costs no time of its own; at most PIPELINE_DEPTH are in
        flight, each packed one in its own staging buffer (reused from push to push)."""
        in_flight: deque[tuple[Pending, int | None]] = deque()  # (broadcast, its staging slot)
        free = list(range(PIPELINE_DEPTH))

        def retire_oldest() -> None:
            done, slot = in_flight.popleft()
            done.wait()
            if slot is not None:
                free.append(slot)

        for b in buckets:
            buf, slot = self._direct(tensors, b), None
            if buf is None:
                while not free:
                    retire_oldest()
                slot = free.pop()
                buf = self._staging(slot, b.nbytes)
                _pack(tensors, b, buf)
            in_flight.append((self.group.broadcast_async(buf), slot))
            while len(in_flight) > PIPELINE_DEPTH:
                retire_oldest()
        while in_flight:
            retire_oldest()

    def _staging(self, slot: int, nbytes: int) -> torch.Tensor:
        """Staging buffer `slot`, at least `nbytes` (<= the bucket cap), kept for the next push:
        fresh memory costs page faults worth several copies."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self._buffers[slot] = None
            buf = self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.group.device)
        return buf[:nbytes]

    def _collect(self, named_tensors, dtype) -> tuple[list[torch.Tensor], PushHeader]:
        """Metadata of every tensor, built before anything is sent. A failure here (a bad
        iterable, duplicate names) still goes out, as the header's error, so receivers stop too."""
        tensors, metas, names = [], [], set()
        try:
            for name, t in named_tensors:
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name!r} is a {type(t).__name__}, not a tensor")
                if name in names:
                    raise ValueError(f"duplicate tensor name {name!r}")
                names.add(name)
                t = t.detach()
                out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
                tensors.append(t)  # cast while packing, one bucket at a time
                metas.append(TensorMeta(name, dtype_name(out_dtype), list(t.shape)))
        except Exception as e:  # noqa: BLE001 - reported to the receivers, then re-raised
            return [], PushHeader([], self.bucket_bytes, error=f"{type(e).__name__}: {e}")
        return tensors, PushHeader(metas, self.bucket_bytes)

    def _send_header(self, header: PushHeader) -> None:
        payload = _encode(header)
        self.group.broadcast(torch.tensor([len(payload)], dtype=torch.int64, device=self.group.device))
        self.group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.group.device))

    def _direct(self, tensors: list[torch.Tensor], b: Bucket) -> torch.Tensor | None:
        """The bucket's bytes straight from the tensor's storage, when it is alone in the bucket
        and already has the wire's device, dtype and layout (no copy); else None."""
        t = tensors[b.indices[0]]
        if len(b.indices) != 1 or t.device != self.group.device or dtype_name(t.dtype) != b.dtype:
            return None
        if not t.is_contiguous():
            return None
        flat = t.reshape(-1).view(torch.uint8)
        start = max(b.piece_start, 0)
        return flat[start : start + b.nbytes]


def _pack(tensors: list[torch.Tensor], b: Bucket, buf: torch.Tensor) -> None:
    """Copy (and cast, and move across devices) the bucket's tensors into the byte buffer."""
    dtype = parse_dtype(b.dtype)
    if b.piece_start >= 0:  # a piece of one large tensor: elements [a, a + n) of its flat view
        i = b.indices[0]
        if not tensors[i].is_contiguous():  # rare (a transposed view): one copy, reused by its later pieces
            tensors[i] = tensors[i].contiguous()
        a, n = b.piece_start // dtype.itemsize, b.nbytes // dtype.itemsize
        _copy(buf.view(dtype), tensors[i].view(-1)[a : a + n])
        return
    for i, offset in zip(b.indices, b.offsets):
        t = tensors[i]
        _copy(buf[offset : offset + t.numel() * dtype.itemsize].view(dtype).view(t.shape), t)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst.copy_(src) (returns dst), on one thread for CPU -> CPU: a plain memcpy without a cast,
    torch's copy (a cast, a strided slice) inside `one_thread` otherwise.

    Packing is memory-bound, and one thread already outruns loopback TCP; torch's OpenMP copy
    collapses several-fold when the cores are oversubscribed (trainer, engine and gloo's threads
    on one box), measured in benchmarks/weight_transfer.py (its float32>bfloat16 rows: a push
    that casts)."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
    elif dst.dtype == src.dtype and src.is_contiguous() and dst.is_contiguous():
        np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.reshape(-1).view(torch.uint8).numpy())
    else:
        with one_thread():
            dst.copy_(src)
    return dst


@contextmanager
def one_thread():
    """torch's CPU ops in this block run on the calling thread alone (OpenMP's team size is per
    thread; the old size comes back after)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


class WeightReceiver:
    """Ranks 1..N of a `WeightTransferGroup`: receives one push at a time. Keep one for the
    group's life: its bucket buffers are reused from push to push."""

    def __init__(self, group: WeightTransferGroup):
        assert group.rank != 0, "rank 0 is the sender"
        self.group = group
        self.last_stats: dict = {}
        self._buffers: list[torch.Tensor] = []  # free bucket buffers (used when `into` is given)
        self._largest = 0  # the current push's largest bucket (bytes)

    def receive(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
                select: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
                into: Callable[[str], torch.Tensor] | None = None,
                write: Callable[[str, torch.Tensor], torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
        """Receive one push, checked against `expected` (name -> (shape, dtype) of the model).

        Returns name -> tensor for the pushed names only (a subset push is legal), once every
        rank has confirmed the push complete. Without `into` the tensors are fresh (views into
        per-bucket buffers, on `group.device`); with it, `into(name)` is where each one goes (the
        caller's staging memory, of the kept part's shape) and the returned tensors are those.
        `select(name, tensor)`: the part of each tensor to keep (a tensor-parallel rank's
        slice), taken as its bucket arrives so that no receiver holds the whole push.
        `write(name, part)`: stages a received tensor another way than a copy into `into(name)`
        (the engine packs its matmul's panels straight from the bucket) and returns what stands
        for it, or None to have it copied; a large tensor's pieces still land in `into(name)`
        first. Buckets are received one ahead of the one being unpacked, and every copy and
        write runs on this thread alone (the transport's threads want the other cores). Raises
        `WeightTransferError` with the reason if this receiver refuses, another rank refuses or
        fails, or the transport fails.
        """
        t0 = time.perf_counter()
        header = self._recv_header()
        if header.error:
            self.group.all_reduce_max(OK)
            raise WeightPushRefused(f"the sender aborted the push: {header.error}")
        reason = check_header(header, expected)
        status = self.group.all_reduce_max(REFUSED if reason else OK)
        if reason:
            raise WeightPushRefused(f"push refused by rank {self.group.rank}: {reason}")
        if status != OK:
            raise WeightPushRefused("push refused by another receiver (see its exception); nothing was received")
        out: dict[str, torch.Tensor] = {}
        buckets = plan_buckets(header)
        self._largest = max((b.nbytes for b in buckets), default=0)
        try:
            posted: deque[tuple[Bucket, Pending | None, torch.Tensor]] = deque()
            with one_thread():
                for b in buckets:
                    posted.append((b, *self._post(header, b, out, select, into)))
                    if len(posted) >= PIPELINE_DEPTH:
                        self._unpack(header, *posted.popleft(), out, select, into, write)
                while posted:
                    self._unpack(header, *posted.popleft(), out, select, into, write)
        except WeightTransferError:
            raise
        except BaseException as e:  # the sender would block on us: break the group so it fails now
            self.group.abort(f"receiver rank {self.group.rank} failed mid-push: {e!r}")
            raise WeightTransferError(f"receiver failed mid-push, group aborted: {e!r}") from e
        if self.group.all_reduce_max(OK) != OK:
            raise WeightTransferError("another rank failed mid-push; discarding the staged tensors")
        num_bytes = sum(_nbytes(m) for m in header.tensors)
        seconds = time.perf_counter() - t0
        self.last_stats = {
            "num_tensors": len(out),
            "num_bytes": num_bytes,
            "num_buckets": sum(1 for b in buckets if b.nbytes),
            "seconds": seconds,
            "gb_per_s": num_bytes / seconds / 1e9,
        }
        return out

    def _post(self, header: PushHeader, b: Bucket, out: dict, select, into) -> tuple[Pending | None, torch.Tensor]:
        """Start receiving bucket `b`: into its tensor's memory (a piece of a large tensor), or
        into a bucket buffer."""
        if b.piece_start >= 0:
            m = header.tensors[b.indices[0]]
            if b.piece_start == 0:  # the tensor's memory: the destination itself when it can take the bytes
                dest = into(m.name) if into is not None and select is None else None
                if dest is None or not dest.is_contiguous():
                    dest = torch.empty(m.shape, dtype=parse_dtype(m.dtype), device=self.group.device)
                out[m.name] = dest
            flat = out[m.name].view(-1).view(torch.uint8)[b.piece_start : b.piece_start + b.nbytes]
            return self.group.broadcast_async(flat), flat
        if into is None:  # the tensors are views into the buffer: a fresh one per bucket
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=self.group.device)
        else:
            buf = self._buffer(b.nbytes)[: b.nbytes]
        return (self.group.broadcast_async(buf) if b.nbytes else None), buf

    def _unpack(self, header: PushHeader, b: Bucket, pending: Pending | None, buf: torch.Tensor, out: dict,
                select, into, write) -> None:
        """Wait for bucket `b`, then hand its tensors over (views, or copies into `into`, or
        what `write` made of them)."""
        if pending is not None:
            pending.wait()
        dtype = parse_dtype(b.dtype)
        if b.piece_start >= 0:
            m = header.tensors[b.indices[0]]
            if b.piece_start + b.nbytes == _nbytes(m):  # its last piece: the whole tensor is here
                t = out[m.name]
                part = t if select is None else select(m.name, t)
                written = write(m.name, part) if write is not None else None
                if written is not None:
                    out[m.name] = written
                elif into is not None and part.data_ptr() != into(m.name).data_ptr():
                    out[m.name] = _copy(into(m.name), part)
                elif part is not t:
                    out[m.name] = part.clone()  # a copy: the whole tensor can go
            return
        for i, offset in zip(b.indices, b.offsets):
            m = header.tensors[i]
            t = buf[offset : offset + _nbytes(m)].view(dtype).view(m.shape)
            part = t if select is None else select(m.name, t)
            written = write(m.name, part) if write is not None else None
            if written is not None:
                out[m.name] = written
            elif into is not None:
                out[m.name] = _copy(into(m.name), part)
            else:
                out[m.name] = part if part is t else part.clone()  # (a slice: the bucket buffer can go)
        if into is not None:
            self._buffers.append(buf._base if buf._base is not None else buf)  # whole, as it was taken

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A bucket buffer of at least `nbytes`, kept for later buckets and pushes (fresh memory
        costs page faults worth several copies). Each is handed back whole and a new one holds
        the push's largest bucket, so that a push's smaller last bucket of a dtype does not leave
        a shrunken buffer that the next full one must replace."""
        for k, buf in enumerate(self._buffers):
            if buf.numel() >= nbytes:
                return self._buffers.pop(k)
        if self._buffers:
            self._buffers.pop()
        return torch.empty(max(nbytes, self._largest), dtype=torch.uint8, device=self.group.device)

    def _recv_header(self) -> PushHeader:
        length = torch.zeros(1, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(length)
        n = int(length.item())
        if not 0 < n <= MAX_HEADER_BYTES:  # the sender speaks another protocol: what follows is unknown
            self.group.abort(f"bad push header length {n}")
            raise WeightTransferError(f"bad push header length {n} (protocol mismatch?); group aborted")
        payload = torch.empty(n, dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(payload)
        try:
            return _decode(payload.cpu().numpy().tobytes())
        except msgspec.DecodeError as e:
            self.group.abort(f"undecodable push header: {e}")
            raise WeightTransferError(f"undecodable push header (protocol mismatch?): {e}; group aborted") from e
