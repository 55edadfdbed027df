"""The control plane's table (engine/process/utility.py): every verb is an EngineCore method
whose parameters are its argument struct's fields, calls are bound and typed before anything
runs, and replicas' answers combine as declared."""
import inspect
import time

import msgspec
import pytest

from engine.core.engine_core import EngineCore
from engine.errors import EngineStateError, InvalidRequestError
from engine.process.utility import UTILITIES, UpdateTrace, bind, combine, replicas_for, weight_update_plan


@pytest.mark.parametrize("name", sorted(UTILITIES))
def test_every_verb_is_a_core_method_with_the_declared_parameters(name):
    params = list(inspect.signature(getattr(EngineCore, name)).parameters.values())[1:]  # (self)
    fields = UTILITIES[name].arguments.__struct_fields__
    assert [p.name for p in params] == list(fields)
    defaults = UTILITIES[name].arguments.__struct_defaults__
    declared = dict(zip(fields[len(fields) - len(defaults):], defaults))
    assert {p.name: p.default for p in params if p.default is not p.empty} == declared


def test_nothing_else_is_reachable():
    for method in ("step", "add_request", "abort_all", "take_pending_outputs", "shutdown", "_set_pause", "", None):
        with pytest.raises(InvalidRequestError, match="no method"):
            bind(method, [], {})


def test_bind_names_and_types_the_arguments():
    assert bind("pause_generation", ["keep"], {"timeout_s": 2}) == {
        "mode": "keep", "clear_cache": True, "timeout_s": 2.0, "recompute_kv": False, "unless_paused": False}
    for method, args, kwargs, field in (("pause_generation", ["keep", "yes"], {}, "clear_cache"),
                                        ("sleep", [], {"level": "2"}, "level"),
                                        ("sleep", [], {"depth": 2}, "depth"),
                                        ("sleep", [1, "abort", 3], {}, "method"),
                                        ("pause_generation", ["abort"], {"mode": "keep"}, "mode")):
        with pytest.raises(InvalidRequestError) as e:
            bind(method, args, kwargs)
        assert e.value.param == field, (method, args, kwargs, str(e.value))
    with pytest.raises(InvalidRequestError, match="missing required field `world_size`"):
        bind("init_weight_transfer", ["127.0.0.1", 1234], {})


def test_answers_combine_as_declared():
    assert combine("is_paused", [False, True]) is True
    assert combine("collective_rpc", [[1], [2, 3]]) == [1, 2, 3]
    assert combine("pause_generation", [{"aborted": 1, "kept": 0, "mode": "abort"},
                                        {"aborted": 2, "kept": 0, "mode": "abort"}])["aborted"] == 3
    assert combine("resume_generation", [{"paused_seconds": None}, {"paused_seconds": 2.0}]) == {"paused_seconds": 2.0}
    assert combine("weights_checksum", ["a", "a"]) == "a"
    with pytest.raises(EngineStateError, match="disagree on weights_checksum"):
        combine("weights_checksum", ["a", "b"])
    assert combine("get_stats", [{"num_running": 1}])["num_replicas_alive"] == 1


def test_save_weights_goes_to_the_first_replica_only():
    """One folder, written by the first live replica; every other verb reaches them all."""
    assert replicas_for("save_weights", ["r0", "r1"]) == ["r0"]
    for method in ("apply_model", "pause_generation", "no_such_verb", None):
        assert replicas_for(method, ["r0", "r1"]) == ["r0", "r1"]
    assert combine("apply_model", [[1], [2]]) == [1, 2]  # one result per worker of every replica


def test_weight_update_plan_stages_then_commits_or_discards():
    trace = UpdateTrace()
    plan = weight_update_plan("disk", ["/w"], None, trace=trace)
    assert plan.send(None) == ("each", "stage_weights", {"source": "disk", "args": ["/w"], "lora_id": 0,
                                                         "update_id": trace.update_id})
    assert trace.phase == "receive"
    how, method, kwargs = plan.send([{"weight_version": 3}, {"weight_version": 3}])
    assert (how, method, kwargs["version"]) == ("each", "commit_weights", 4) and trace.phase == "swap"
    assert kwargs["update_id"] == trace.update_id  # (another frontend's update staged meanwhile is not made live)
    with pytest.raises(StopIteration) as done:
        plan.send([{"weight_version": 4, "swap_s": 0.5, "clear_cache_s": 0.25}] * 2)
    assert done.value.value["weight_version"] == 4
    assert trace.phase == "done" and set(trace.seconds) == {"receive", "stage", "swap", "clear_cache"}
    assert trace.seconds["clear_cache"] == 0.25
    trace = UpdateTrace()
    refused = weight_update_plan("disk", ["/w"], 2, trace=trace)
    refused.send(None)
    assert refused.send([{"weight_version": 3}, {"weight_version": 3}]) == \
        ("each", "discard_weights", {"update_id": trace.update_id})
    with pytest.raises(EngineStateError, match="must increase"):
        refused.send([True, True])
    assert trace.phase == "stage"


def test_weight_update_plan_pauses_for_the_swap_or_first():
    """With `pause` the plan pauses generation itself: once every replica staged (an engine that
    receives beside its steps), or before staging; a pause that fails or runs out of time
    discards the update and leaves trace.paused saying the caller resumes; a commit refused
    (asleep, or resumed meanwhile by another frontend) is discarded everywhere too."""
    trace = UpdateTrace()
    plan = weight_update_plan("disk", ["/w"], None, trace=trace, pause={"mode": "keep"}, pause_first=False)
    assert plan.send(None)[1] == "stage_weights"
    how, method, kwargs = plan.send([{"weight_version": 3}, {"weight_version": 3}])
    assert (how, method, trace.phase) == ("each", "pause_generation", "pause")
    assert kwargs == {"mode": "keep", "clear_cache": False, "unless_paused": True, "timeout": None}
    how, method, kwargs = plan.send([{"aborted": 0, "kept": k, "mode": "keep", "was_paused": False} for k in (1, 2)])
    assert (how, method, kwargs["version"]) == ("each", "commit_weights", 4)
    with pytest.raises(StopIteration) as done:
        plan.send([{"weight_version": 4, "swap_s": 0.1, "clear_cache_s": 0.0}] * 2)
    assert done.value.value["paused"] == {"aborted": 0, "kept": 3, "mode": "keep", "was_paused": False}
    assert list(trace.seconds) == ["receive", "stage", "pause", "swap", "clear_cache"]

    first = weight_update_plan("disk", ["/w"], None, pause={"mode": "abort"})  # (pause_first: the default)
    assert first.send(None)[1] == "pause_generation"
    assert first.send([{"aborted": 1, "kept": 0, "mode": "abort", "was_paused": True}])[1] == "stage_weights"

    trace = UpdateTrace()
    late = weight_update_plan("disk", ["/w"], None, deadline_s=30, trace=trace, pause={"mode": "wait"},
                              pause_first=False)
    late.send(None)
    assert 0 < late.send([{"weight_version": 0}])[2]["timeout"] <= 30  # what is left of the deadline
    assert late.send([TimeoutError("pause_generation did not answer within 29 s")])[1] == "discard_weights"
    with pytest.raises(TimeoutError, match="deadline passed while pausing generation"):
        late.send([True])
    assert trace.phase == "pause" and trace.paused["was_paused"] is False

    for answers, match in (([EngineStateError("the weights are asleep")] * 2, "asleep"),
                           ([{"weight_version": 1}, EngineStateError("the weights are asleep")], "1 of 2 replicas")):
        refused = weight_update_plan("disk", ["/w"], None, pause={"mode": "keep"}, pause_first=False)
        refused.send(None)
        refused.send([{"weight_version": 0}] * 2)
        assert refused.send([{"aborted": 0, "kept": 0, "mode": "keep", "was_paused": True}] * 2)[1] == \
            "commit_weights"
        assert refused.send(answers)[1] == "discard_weights"
        with pytest.raises(EngineStateError, match=match):
            refused.send([True, True])


def test_weight_update_plan_names_the_phase_that_failed_and_keeps_its_deadline():
    """A refusal of what was sent fails "stage"; a transport failure beside it is the one raised,
    as "receive"; the deadline goes to every replica's staging, and an update staged past it
    is discarded, not made live."""
    from weight_sync import WeightPushRefused, WeightTransferError

    trace = UpdateTrace()
    plan = weight_update_plan("broadcast", [], None, deadline_s=0.2, trace=trace)
    assert plan.send(None)[2]["deadline_s"] == 0.2
    assert plan.send([WeightPushRefused("shape"), WeightTransferError("peer died")])[1] == "discard_weights"
    with pytest.raises(WeightTransferError, match="peer died"):
        plan.send([True, True])
    assert trace.phase == "receive"
    plan = weight_update_plan("broadcast", [], None, trace=trace)
    plan.send(None)
    assert plan.send([WeightPushRefused("shape"), {"weight_version": 1}])[1] == "discard_weights"
    with pytest.raises(WeightPushRefused):
        plan.send([True, True])
    assert trace.phase == "stage"
    late = weight_update_plan("disk", ["/w"], None, deadline_s=0.05, trace=trace)
    late.send(None)
    time.sleep(0.1)  # staging took past the deadline
    assert late.send([{"weight_version": 1}])[1] == "discard_weights"
    with pytest.raises(TimeoutError, match="deadline"):
        late.send([True])
    assert trace.phase == "stage"
    for verb in UTILITIES.values():  # the structs are wire-safe
        assert issubclass(verb.arguments, msgspec.Struct)
