"""Property tests (hypothesis) on what crosses the engine's boundaries: SamplingParams built from
arbitrary values, and the msgspec wire structs between the frontend and the engine core.

- SamplingParams(**fields) either builds or raises InvalidRequestError (a ValueError naming the
  field), never another exception; whatever builds travels the wire and comes back equal.
- Every wire struct round-trips through MsgpackEncoder / MsgpackDecoder unchanged.
- Arbitrary bytes given to the engine core's decoders raise msgspec's errors only (the core's
  input thread drops such a message and goes on), never anything else.
"""
import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import InvalidRequestError
from engine.serial import MsgpackDecoder, MsgpackEncoder
from engine.protocol import EngineCoreRequest, StreamInput, UtilityRequest
from engine.sampling_params import SamplingParams

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

anything = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.one_of(st.integers(min_value=-(1 << 70), max_value=1 << 70), st.text(max_size=4)), max_size=4))
plausible = {
    "n": st.integers(0, 8), "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 100), "min_p": st.floats(-0.5, 1.5), "seed": st.integers(-(1 << 65), 1 << 65),
    "max_tokens": st.integers(-2, 1 << 40), "min_tokens": st.integers(-2, 64),
    "stop": st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3)),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-(1 << 65), 1 << 65), max_size=3)),
    "ignore_eos": st.booleans(), "logprobs": st.one_of(st.none(), st.integers(-2, 40)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(-2, 40)),
    "logprobs_mode": st.sampled_from(["processed", "raw", "other"]), "detokenize": st.booleans(),
}


@st.composite
def sampling_fields(draw) -> dict:
    names = draw(st.lists(st.sampled_from(sorted(plausible)), unique=True, max_size=6))
    return {name: draw(st.one_of(plausible[name], anything)) for name in names}


@FAST
@given(sampling_fields())
def test_sampling_params_build_or_name_the_field(fields):
    try:
        params = SamplingParams(**fields)
    except InvalidRequestError as e:
        assert e.param and e.param in fields, f"the error names {e.param!r}, not one of {sorted(fields)}"
        return
    for name in ("temperature", "top_p", "min_p"):
        assert math.isfinite(getattr(params, name)), f"{name} = {getattr(params, name)} was accepted"
    frames = MsgpackEncoder().encode(params)
    assert MsgpackDecoder(SamplingParams).decode(frames) == params


token_ids = st.lists(st.integers(0, (1 << 31) - 1), max_size=64)
valid_params = sampling_fields().filter(lambda f: _builds(f)).map(lambda f: SamplingParams(**f))


def _builds(fields: dict) -> bool:
    try:
        SamplingParams(**fields)
        return True
    except InvalidRequestError:
        return False


@FAST
@given(st.text(max_size=40), token_ids, valid_params, st.one_of(st.none(), st.integers(0, 1 << 31)), st.booleans())
def test_engine_core_requests_round_trip(rid, ids, params, eos, streaming):
    req = EngineCoreRequest(rid, ids, params, eos, streaming)
    assert MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req)) == req
    chunk = StreamInput(rid, ids, params, streaming)
    assert MsgpackDecoder(StreamInput).decode(MsgpackEncoder().encode(chunk)) == chunk


DECODERS = [EngineCoreRequest, list[EngineCoreRequest], StreamInput, list[str], UtilityRequest]


@FAST
@given(st.binary(max_size=256), st.sampled_from(DECODERS))
def test_undecodable_bytes_raise_msgspec_errors_only(data, kind):
    try:
        MsgpackDecoder(kind).decode([data])
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


wire_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(1 << 63), (1 << 64) - 1), st.floats(), st.text(max_size=8),
              st.binary(max_size=8)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)),
    max_leaves=12)


@FAST
@given(st.lists(wire_values, max_size=6), st.sampled_from(DECODERS))
def test_well_formed_msgpack_of_the_wrong_shape_raises_msgspec_errors_only(values, kind):
    try:
        MsgpackDecoder(kind).decode([msgspec.msgpack.encode(values)])
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass


MALFORMED_EXTENSIONS = [
    msgspec.msgpack.Ext(1, b"\xc1"),  # not msgpack
    msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("float32", [2], 7))),  # no such frame
    msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("no_such_dtype", [2], 0))),
    msgspec.msgpack.Ext(1, msgspec.msgpack.encode(("float32", [3], 0))),  # the frame is too short
    msgspec.msgpack.Ext(1, msgspec.msgpack.encode(["float32"])),  # the wrong shape of header
    msgspec.msgpack.Ext(2, msgspec.msgpack.encode(("<f4", [5], 0))),
    msgspec.msgpack.Ext(9, b""),  # an unknown extension
]


@pytest.mark.parametrize("ext", MALFORMED_EXTENSIONS, ids=range(len(MALFORMED_EXTENSIONS)))
def test_malformed_tensor_extensions_raise_msgspec_errors_only(ext):
    frames = [msgspec.msgpack.encode([1, "method", [ext], {}]), b"\x00" * 6]
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        MsgpackDecoder(UtilityRequest).decode(frames)
