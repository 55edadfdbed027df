"""msgpack (msgspec) encoding of engine messages into ZMQ frames; tensors are never pickled.

A tensor (or numpy array) inside a message becomes a msgpack Ext holding (dtype, shape, frame
index), and its bytes travel as an extra frame sent without copying. The receiver maps those
frames straight into tensors (no copy; the tensor keeps the frame alive).
"""
import warnings
from typing import Any

import msgspec
import numpy as np
import torch

TENSOR_EXT = 1
NDARRAY_EXT = 2


class MsgpackEncoder:
    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._frames: list | None = None

    def encode(self, obj: Any) -> list:
        """obj -> [main frame, tensor frames...]"""
        self._frames = [b""]
        try:
            self._frames[0] = self._encoder.encode(obj)
            return self._frames
        finally:
            self._frames = None

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().to("cpu").contiguous()
            dtype = str(t.dtype).removeprefix("torch.")
            self._frames.append(t.view(-1).view(torch.uint8).numpy().data if t.numel() else b"")
            return msgspec.msgpack.Ext(TENSOR_EXT, msgspec.msgpack.encode((dtype, list(t.shape), len(self._frames) - 1)))
        if isinstance(obj, np.ndarray):
            a = np.ascontiguousarray(obj)
            self._frames.append(a.data if a.size else b"")
            return msgspec.msgpack.Ext(NDARRAY_EXT, msgspec.msgpack.encode((a.dtype.str, list(a.shape), len(self._frames) - 1)))
        if isinstance(obj, (set, frozenset)):
            return list(obj)
        raise TypeError(f"cannot send a {type(obj).__name__} between processes (msgpack types and tensors only)")


class MsgpackDecoder:
    def __init__(self, t: Any = Any):
        self._decoder = msgspec.msgpack.Decoder(t, ext_hook=self._ext_hook)
        self._frames: list | None = None

    def decode(self, frames: list) -> Any:
        """frames: [main, tensor frames...] as bytes, memoryviews or zmq Frames."""
        self._frames = frames
        try:
            return self._decoder.decode(_buf(frames[0]))
        except UnicodeDecodeError as e:  # msgspec lets a malformed string through as this
            raise msgspec.DecodeError(f"invalid UTF-8 in a string: {e}") from None
        finally:
            self._frames = None

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        try:
            return self._tensor(code, data)
        except msgspec.DecodeError:
            raise
        except Exception as e:  # a malformed header or frame: the message is undecodable, like bad msgpack
            raise msgspec.DecodeError(f"malformed tensor extension {code}: {type(e).__name__}: {e}") from None

    def _tensor(self, code: int, data: memoryview) -> Any:
        dtype, shape, idx = msgspec.msgpack.decode(data)
        buf = _buf(self._frames[idx])
        if code == TENSOR_EXT:
            torch_dtype = getattr(torch, dtype)
            if not len(buf):
                return torch.empty(shape, dtype=torch_dtype)
            with warnings.catch_warnings():  # zmq frames are read-only; we never write into them
                warnings.simplefilter("ignore")
                return torch.frombuffer(buf, dtype=torch.uint8).view(torch_dtype).view(shape)
        if code == NDARRAY_EXT:
            return np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
        raise ValueError(f"unknown msgpack extension {code}")


def _buf(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)
