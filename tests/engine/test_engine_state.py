"""The engine core as the one owner of pause and sleep state, on a tiny random-weight model:

- random sequences of pause (abort / wait / keep), resume, sleep (levels 1 and 2, every pause
  mode), wake_up (by part), reload and new requests: after every call `is_paused()` and
  `is_sleeping()` say what the documented rules say, and whenever they say generation can run,
  every admitted request runs to completion (no call sequence wedges the engine);
- the sequences that used to wedge the HTTP server (keep -> abort -> resume; a sleep in keep
  mode -> pause wait -> wake -> resume);
- held requests (arrived while paused) and frozen ones (pause keep) make no progress;
- LLM and AsyncLLM expose the same control methods under the same names.
"""
import inspect
import random
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, AsyncLLM, EngineStateError, SamplingParams
from engine.config import EngineConfig
from engine.core.engine_core import Deferred, EngineCore
from engine.default_model import default_model_path
from engine.protocol import EngineCoreRequest, FinishReason

MAX_TOKENS = 6


@pytest.fixture()
def core(tiny_folder):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    core = EngineCore(EngineConfig(model=tiny_folder, dtype="float32", kv_cache_memory=8 << 20,
                                   tokenizer=str(default_model_path())))
    yield core
    core.shutdown()
    torch.set_num_threads(threads)


class Model:
    """The documented rules, written out independently of the engine."""

    def __init__(self):
        self.paused = self.paused_by_sleep = self.needs_weights = False
        self.asleep: set[str] = set()

    def pause(self):
        self.paused, self.paused_by_sleep = True, False

    def resume(self):
        self.paused = self.paused_by_sleep = False

    def sleep(self, level):
        if not self.paused:
            self.paused = self.paused_by_sleep = True
        self.asleep = {"weights", "kv_cache"}
        self.needs_weights = self.needs_weights or level == 2

    def wake(self, tags):
        self.asleep -= set(tags)
        if not self.asleep and self.paused_by_sleep:
            self.resume()

    @property
    def can_generate(self) -> bool:
        return not (self.paused or self.asleep or self.needs_weights)


def settle(core: EngineCore, result):
    """Answer a Deferred as the engine-core process would: step until it can (if anything can run)."""
    if not isinstance(result, Deferred):
        return result
    for _ in range(1000):
        if result.done():
            return result.finish()
        if result.thread is not None:
            result.thread.join(60)
        elif not core.has_work():
            return None  # waits for a later call (resume, wake_up) in a real server
        else:
            core.step()
    raise AssertionError("a deferred call never finished")


def stage(core: EngineCore, source: str, args: list) -> dict:
    """stage_weights, its receive beside the steps waited for without stepping."""
    return settle(core, core.stage_weights(source, args))


def add(core: EngineCore, rid: str):
    core.add_request(EngineCoreRequest(rid, [1, 2, 3, 4],
                                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), None))


def reload(core: EngineCore) -> None:
    """The start-up weights again, as a frontend updates weights: stage, then commit."""
    stage(core, "reload", [])
    core.commit_weights(core.weight_version + 1)


def run_until_idle(core: EngineCore, finished: dict) -> None:
    for _ in range(500):
        if not core.has_work():
            return
        for o in core.step():
            if o.finished:
                finished[o.request_id] = o.finish_reason
    raise AssertionError("the engine kept stepping")


@pytest.mark.parametrize("seed", range(12))
def test_random_control_sequences_never_wedge(core, seed):
    rng = random.Random(seed)
    model = Model()
    finished: dict = {}
    ops = ["add", "add", "step", "pause_abort", "pause_wait", "pause_keep", "resume", "resume", "sleep1", "sleep2",
           "sleep_keep", "sleep_wait", "wake", "wake_weights", "wake_kv", "reload"]
    for i in range(60):
        op = rng.choice(ops)
        if op == "add":
            if model.asleep or model.needs_weights:
                with pytest.raises(EngineStateError):
                    add(core, f"s{seed}-{i}")
            else:
                add(core, f"s{seed}-{i}")
        elif op == "step":
            for o in core.step():
                if o.finished:
                    finished[o.request_id] = o.finish_reason
        elif op.startswith("pause"):
            settle(core, core.pause_generation(op.split("_")[1]))
            model.pause()
        elif op == "resume":
            core.resume_generation()
            model.resume()
        elif op.startswith("sleep"):
            level, mode = (1, op.split("_")[1]) if "_" in op else (int(op[-1]), "abort")
            settle(core, core.sleep(level, mode))
            model.sleep(level)
        elif op.startswith("wake"):
            tags = {"wake": ["weights", "kv_cache"], "wake_weights": ["weights"], "wake_kv": ["kv_cache"]}[op]
            assert core.wake_up(tags)["is_sleeping"] == bool(model.asleep - set(tags))
            model.wake(tags)
        elif op == "reload":
            if "weights" in model.asleep:
                with pytest.raises(EngineStateError, match="asleep"):
                    reload(core)
                continue
            try:
                reload(core)
            except EngineStateError:  # admitted requests can still run: refused, nothing changed
                assert core.scheduler.has_active() and core.pause.state.value != "paused_all"
                continue
            model.needs_weights = False
        assert core.is_paused() == model.paused, (i, op)
        assert core.is_sleeping() == bool(model.asleep), (i, op)
        if model.can_generate:  # nothing may be stuck: every admitted request finishes
            run_until_idle(core, finished)
            assert not core.scheduler.requests, (i, op)
    # finally: wake, refill, resume -> everything still in the engine completes
    core.wake_up()
    reload(core)
    core.resume_generation()
    run_until_idle(core, finished)
    assert not core.scheduler.requests
    assert set(finished.values()) <= {FinishReason.LENGTH, FinishReason.ABORT}


def test_the_sequences_that_wedged_the_server(core):
    add(core, "a")
    core.step()
    core.pause_generation("keep")
    core.pause_generation("abort")  # a second pause replaces the keep state
    assert core.is_paused()
    core.resume_generation()
    assert not core.is_paused()
    add(core, "b")
    finished = {}
    run_until_idle(core, finished)
    assert finished == {"a": FinishReason.ABORT, "b": FinishReason.LENGTH}

    add(core, "c")
    core.step()
    assert core.sleep(1, "keep") is True  # keep: "c" is frozen, loses its KV, recomputes later
    # "c" cannot drain while the engine sleeps: the wait answers at once instead of blocking the
    # caller (and, in the server, every control route) until somebody else wakes the engine
    assert settle(core, core.pause_generation("wait")) == {"aborted": 0, "kept": 0, "mode": "wait"}
    assert core.wake_up()["is_sleeping"] is False
    assert core.is_paused()  # the explicit pause outlives the wake-up
    run_until_idle(core, finished)  # "c" was admitted before the wait pause: it runs to its end
    assert core.is_paused()
    core.resume_generation()
    assert finished["c"] == FinishReason.LENGTH and not core.is_paused()


def test_a_pause_unless_paused_leaves_an_existing_pause_as_it_is(core):
    """POST /weights/update's pause: one call that pauses what runs, or leaves the caller's own
    pause (its mode, what it kept) exactly as it was, and says which."""
    add(core, "a")
    core.step()
    assert core.pause_generation("keep", unless_paused=True) == {"aborted": 0, "kept": 1, "mode": "keep",
                                                                 "was_paused": False}
    assert core.pause_generation("abort", unless_paused=True)["was_paused"] is True
    assert core.is_paused() and "a" in core.scheduler.requests  # still kept, not aborted
    core.resume_generation()
    finished = {}
    run_until_idle(core, finished)
    assert finished == {"a": FinishReason.LENGTH}


def test_held_and_frozen_requests_make_no_progress(core):
    add(core, "running")
    core.step()
    assert core.pause_generation("abort") == {"aborted": 1, "kept": 0, "mode": "abort"}
    add(core, "held")
    assert [(o.request_id, o.finish_reason) for o in core.step()] == [("running", FinishReason.ABORT)]
    for _ in range(3):
        assert core.step() == []
    assert core.scheduler.requests["held"].num_computed_tokens == 0
    core.resume_generation()
    core.step()
    held = core.scheduler.requests["held"]
    assert held.num_output_tokens == 1
    core.pause_generation("keep")
    assert not core.has_work() and core.step() == []
    assert held.num_output_tokens == 1
    core.pause_generation("wait")  # a wait pause lets the frozen request run to its end
    finished = {}
    run_until_idle(core, finished)
    assert finished == {"held": FinishReason.LENGTH}


def _control_methods(cls) -> set[str]:
    # scale, cancel_scale, has_request and wait_for_requests_to_drain: online verbs (an offline LLM
    # has nothing in flight between generate() calls: build it with the data_parallel_size it
    # needs); generate and encode take a batch offline and one prompt (with a request id) online,
    # as vLLM's do
    return {n for n, f in inspect.getmembers(cls, callable) if not n.startswith("_")} - {
        "generate", "encode", "chat", "abort", "shutdown", "scale", "cancel_scale", "has_request",
        "wait_for_requests_to_drain"}


def test_llm_and_async_llm_have_the_same_control_methods():
    assert _control_methods(LLM) == _control_methods(AsyncLLM)
    for name in _control_methods(LLM):
        sync, coro = inspect.signature(getattr(LLM, name)), inspect.signature(getattr(AsyncLLM, name))
        assert list(sync.parameters) == list(coro.parameters), name


def test_weight_versions_increase_strictly(tiny_folder):
    """A version at or below the live one is refused (the weights stay as they were), so a
    token's version names one set of weights; the default is the live version + 1."""
    llm = LLM(model=tiny_folder, tokenizer=str(default_model_path()), dtype="float32", multiprocess=False,
              kv_cache_memory=8 << 20)
    try:
        assert llm.reload_weights(version=3)["weight_version"] == 3
        checksum = llm.weights_checksum()
        for stale in (3, 1, -1):
            with pytest.raises(EngineStateError, match="must increase") as err:
                llm.reload_weights(version=stale)
            assert err.value.param == "weight_version"
            assert llm.get_weight_version() == 3 and llm.weights_checksum() == checksum
        assert llm.reload_weights()["weight_version"] == 4
        with pytest.raises(EngineStateError, match="must increase"):
            llm.set_weight_version(2)
        assert llm.set_weight_version(4) == 4 and llm.set_weight_version(9) == 9  # relabel: same or later
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]
        assert out.weight_versions == [9, 9]
    finally:
        llm.shutdown()


def push_scaled_weights(core: EngineCore, folder: str):
    """New weights (every layer matrix x 1.5) pushed into the core; returns them as a transformers
    model, the trainer's recompute."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "layers" in name and p.dim() == 2:
                p.mul_(1.5)
    stage(core, "tensors", [list(hf.state_dict().items())])
    core.commit_weights(core.weight_version + 1)
    return hf


def test_an_update_staged_meanwhile_replaces_the_first_whose_commit_is_refused(core, tiny_folder):
    """Two updates at once from two frontends (two API servers, say): the workers hold one staged
    update and a later stage replaces it, so the first's commit is refused (it would make the
    second's tensors live under its version) and its discard leaves the second staged; also when
    the first is still being received beside a running request."""
    from transformers import AutoModelForCausalLM

    from weight_sync import weights_checksum

    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    first, second = ({n: t * scale for n, t in hf.state_dict().items()} for scale in (1.5, 0.5))
    before = core.weights_checksum()
    for running in (False, True):
        if running:
            add(core, "r")
            core.step()
        a = core.stage_weights("tensors", [list(first.items())], update_id=f"a{running}")
        b = core.stage_weights("tensors", [list(second.items())], update_id=f"b{running}")
        assert isinstance(a, Deferred) == isinstance(b, Deferred) == running  # (received beside the steps)
        if running:
            with pytest.raises(EngineStateError, match="replaced by another"):
                settle(core, a)
            settle(core, b)
            core.pause_generation("keep")
        with pytest.raises(EngineStateError, match="replaced by another"):
            core.commit_weights(core.weight_version + 1, update_id=f"a{running}")
        assert core.discard_weights(update_id=f"a{running}") is False
        assert core.weights_checksum() == before  # nothing went live
        core.commit_weights(core.weight_version + 1, update_id=f"b{running}")
        assert core.weights_checksum() == weights_checksum(second.items())
        core.stage_weights("reload", [])
        core.commit_weights(core.weight_version + 1)
        assert core.weights_checksum() == before
        core.resume_generation()


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_keep_mode_kv_policies_against_a_trainer_recompute(core, tiny_folder, recompute_kv):
    """New weights pushed while a request is frozen (pause keep): with recompute_kv its later
    tokens' logprobs are what the new weights give for the whole sequence (a trainer's recompute,
    transformers in float32); by default the old weights' KV is reused and they are not."""

    prompt, params = [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    core.add_request(EngineCoreRequest("r", prompt, params, None))
    tokens, logprobs, versions = [], [], []

    def collect(outputs):
        for o in outputs:
            tokens.extend(o.new_token_ids)
            logprobs.extend(o.new_logprobs)
            versions.extend([o.weight_version] * len(o.new_token_ids))

    while len(tokens) < 4:
        collect(core.step())
    assert core.pause_generation("keep", recompute_kv=recompute_kv)["kept"] == 1
    hf = push_scaled_weights(core, tiny_folder)
    core.resume_generation()
    for _ in range(100):
        if not core.has_work():
            break
        collect(core.step())
    assert len(tokens) == 10 and versions[0] == 0 and versions[-1] == 1
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(prompt) - 1:-1].gather(1, torch.tensor(tokens)[:, None])[:, 0]
    after = [i for i, v in enumerate(versions) if v == 1]
    gap = max(abs(logprobs[i] - ref[i].item()) for i in after)
    if recompute_kv:
        assert gap < 1e-4, f"recomputed KV: {gap} nats from the trainer's recompute"
    else:
        assert gap > 1e-3, "reused KV matched a recompute under the new weights: the test cannot tell them apart"


@pytest.mark.parametrize("recompute_kv", [False, True])
def test_an_idle_session_kv_policy_across_a_push(core, tiny_folder, recompute_kv):
    """A streaming-input request between turns (an HTTP session awaiting its next turn) holds KV
    the old weights computed. A push during a keep pause with recompute_kv makes its next turn
    recompute everything under the new weights (logprobs equal a transformers recompute of the
    whole conversation); without it the old KV is reused (they differ)."""

    from engine.protocol import StreamInput

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    turn1, turn2 = [1, 2, 3, 4, 5, 6], [7, 8, 9]
    core.add_request(EngineCoreRequest("s", turn1, params, None, streaming=True))
    tokens, logprobs, versions = [], [], []

    def run_turn():
        got = []
        for _ in range(100):
            for o in core.step():
                tokens.extend(o.new_token_ids)
                logprobs.extend(o.new_logprobs)
                versions.extend([o.weight_version] * len(o.new_token_ids))
                got.extend(o.new_token_ids)
                if o.finish_reason is not None:
                    assert o.resumable and not o.finished
                    return got
        raise AssertionError("the turn never ended")

    out1 = run_turn()
    assert len(out1) == 4 and "s" in core.scheduler.idle
    core.pause_generation("keep", recompute_kv=recompute_kv)
    hf = push_scaled_weights(core, tiny_folder)
    core.resume_generation()
    core.add_stream_input(StreamInput("s", turn2, None))
    out2 = run_turn()
    assert versions == [0] * 4 + [1] * 4
    convo = turn1 + out1 + turn2 + out2
    with torch.no_grad():
        logits = hf(torch.tensor([convo])).logits[0].float()
    start = len(turn1 + out1 + turn2)
    ref = torch.log_softmax(logits, -1)[start - 1:-1].gather(1, torch.tensor(out2)[:, None])[:, 0]
    gap = max(abs(a - b) for a, b in zip(logprobs[4:], ref.tolist()))
    if recompute_kv:
        assert gap < 1e-4, f"recomputed KV: {gap} nats from the trainer's recompute"
    else:
        assert gap > 1e-3, "reused KV matched a recompute under the new weights: the test cannot tell them apart"


def test_an_llm_dropped_without_shutdown_stops_its_engine_core(tiny_folder):
    def use_and_drop() -> int:
        llm = LLM(tiny_folder, dtype="float32", kv_cache_memory=16 << 20, tokenizer=str(default_model_path()))
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
        return llm.client.manager.pids()[0]

    pid = use_and_drop()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower():
        assert time.monotonic() < deadline, "the engine core outlived its LLM"
        time.sleep(0.05)
