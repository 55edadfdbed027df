"""Weight-version rules of requests (engine/core/staleness.py): max_weight_staleness with
stale_action "finish" / "restart", and min_weight_version. The engine core runs in this process
and the test steps it itself, so each push lands exactly between two chosen steps (the default
model in float32: restarted greedy tokens are compared exactly with a fresh request's)."""
import pytest

from engine import LLM, InvalidRequestError, SamplingParams
from engine.core.streaming import check_streaming_params
from engine.frontend.metrics import engine_metrics
from engine.sampling_params import RequestOutputKind
from tests.engine.hf_reference import CHATS, chat_token_ids
from tests.engine.perturb import perturbed_state


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", multiprocess=False, kv_cache_memory=64 << 20)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def prompts(llm):
    return chat_token_ids(llm.tokenizer, CHATS[:4])


class Driver:
    """Adds requests as LLM.generate does (frontend + core) but steps the core one step at a time."""

    def __init__(self, llm: LLM):
        self.llm, self.latest = llm, {}

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        reqs = self.llm.processor.core_requests(rid, prompt, params)
        self.llm.output_processor.add_request(rid, None, prompt, params, [r.request_id for r in reqs])
        self.llm.client.add_requests([reqs])

    def step(self) -> None:
        msg = self.llm.client.get_output()
        ready, to_abort = self.llm.output_processor.process_outputs(msg.outputs)
        assert not to_abort
        for _, out in ready:
            self.latest[out.request_id] = out

    def tokens(self, rid: str, index: int = 0) -> list[int]:
        out = self.latest.get(rid)
        return [] if out is None else out.outputs[index].token_ids

    def run(self, until, max_steps: int = 200) -> None:
        for _ in range(max_steps):
            if until():
                return
            self.step()
        raise AssertionError("the condition never held")

    def finished(self, *rids: str) -> bool:
        return all(rid in self.latest and self.latest[rid].finished for rid in rids)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0, **kw)


def keep_push(llm: LLM, version: int, tensors=None) -> None:
    """A push while generation is paused in mode keep (what an async trainer does)."""
    llm.pause_generation(mode="keep")
    if tensors is None:
        llm.reload_weights(version=version)
    else:
        llm.update_weights_from_tensors(tensors, version=version)
    llm.resume_generation()


def stale_counts(llm: LLM) -> dict[str, float]:
    return {m.labels["action"]: m.value for m in engine_metrics(llm.get_stats()) if m.name == "rollout_stale_requests"}


def test_bad_values_are_refused():
    for kw, field in [(dict(max_weight_staleness=-1), "max_weight_staleness"),
                      (dict(max_weight_staleness=1.0), "max_weight_staleness"),
                      (dict(max_weight_staleness=True), "max_weight_staleness"),
                      (dict(min_weight_version=-2), "min_weight_version"),
                      (dict(min_weight_version="3"), "min_weight_version"),
                      (dict(stale_action="drop"), "stale_action"),
                      (dict(stale_action="restart", output_kind=RequestOutputKind.DELTA), "stale_action")]:
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**kw)
        assert e.value.param == field and field in str(e.value), (kw, e.value)
    with pytest.raises(InvalidRequestError, match="restart") as e:  # its earlier turns are later input
        check_streaming_params(SamplingParams(max_weight_staleness=0, stale_action="restart"))
    assert e.value.param == "stale_action"


def test_finish_at_the_push_that_makes_a_request_too_stale(llm, prompts):
    """max 0 ends at the first push with its old-version tokens only; max 1 survives one push and
    ends at the second; a request without the field in the same batch runs to its end."""
    before = stale_counts(llm)
    d = Driver(llm)
    v0 = llm.get_weight_version()
    d.add("zero", prompts[0], greedy(40, max_weight_staleness=0))
    d.add("one", prompts[1], greedy(40, max_weight_staleness=1))
    d.add("free", prompts[2], greedy(40))
    d.run(lambda: all(len(d.tokens(r)) >= 3 for r in ("zero", "one", "free")))
    assert llm.client.core.kv.block_ids("zero")
    keep_push(llm, v0 + 1)
    d.step()  # the move applies before this step generates anything
    zero = d.latest["zero"].outputs[0]
    assert d.latest["zero"].finished and zero.finish_reason == "stale"
    assert zero.weight_versions == [v0] * len(zero.token_ids) and len(zero.logprobs) == len(zero.token_ids)
    assert "zero" not in llm.client.core.scheduler.requests and llm.client.core.kv.block_ids("zero") == []
    d.run(lambda: len([v for v in d.latest["one"].outputs[0].weight_versions if v == v0 + 1]) >= 2)
    assert not d.finished("one", "free")
    keep_push(llm, v0 + 2)
    d.step()
    one = d.latest["one"].outputs[0]
    assert one.finish_reason == "stale" and set(one.weight_versions) == {v0, v0 + 1}
    d.run(lambda: d.finished("free"))
    free = d.latest["free"].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 40
    assert set(free.weight_versions) == {v0, v0 + 1, v0 + 2}
    after = stale_counts(llm)
    assert after["finish"] == before.get("finish", 0) + 2 and after["restart"] == before.get("restart", 0)


def test_restart_generates_again_under_the_new_weights(llm, prompts, default_model_path):
    """A restarted request's final tokens all carry the new version and equal a fresh request's
    under the new weights: greedy (with prompt logprobs), and seeded sampling with n=2, whose
    children restart each from its own seed."""
    d = Driver(llm)
    v0 = llm.get_weight_version()
    restart = dict(max_weight_staleness=0, stale_action="restart")
    sampled = SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=0, **restart)
    d.add("greedy", prompts[0], greedy(12, prompt_logprobs=0, **restart))
    d.add("sampled", prompts[1], sampled)
    d.add("free", prompts[2], greedy(30))
    d.run(lambda: len(d.tokens("greedy")) >= 4 and len(d.tokens("sampled", 1)) >= 4)
    state = sorted(perturbed_state(default_model_path).items())
    keep_push(llm, v0 + 1, state)
    d.run(lambda: d.finished("greedy", "sampled", "free"))
    llm.reload_weights(version=v0 + 2)  # (the module's other tests expect the start-up weights)
    g = d.latest["greedy"]
    assert g.outputs[0].finish_reason == "length" and g.outputs[0].weight_versions == [v0 + 1] * 12
    assert d.latest["free"].outputs[0].weight_versions[0] == v0  # the request without the field kept going
    # the same requests, fresh, under the pushed weights
    llm.update_weights_from_tensors(state, version=v0 + 3)
    fresh_g, fresh_s = llm.generate([prompts[0], prompts[1]], [greedy(12, prompt_logprobs=0), sampled.clone(
        max_weight_staleness=None, stale_action="finish")], use_tqdm=False)
    llm.reload_weights(version=v0 + 4)
    assert g.outputs[0].token_ids == fresh_g.outputs[0].token_ids
    assert g.outputs[0].logprobs == pytest.approx(fresh_g.outputs[0].logprobs, abs=1e-4)
    assert g.prompt_logprobs[1:] == pytest.approx(fresh_g.prompt_logprobs[1:], abs=1e-4)  # recomputed, new weights
    s = d.latest["sampled"]
    for i in range(2):
        assert s.outputs[i].weight_versions == [v0 + 1] * 12
        assert s.outputs[i].token_ids == fresh_s.outputs[i].token_ids, i
    assert s.outputs[0].token_ids != s.outputs[1].token_ids
    assert stale_counts(llm)["restart"] >= 3  # greedy and both children


def test_min_weight_version_waits_for_the_push(llm, prompts):
    """A request for a version not live yet holds no KV and generates nothing, survives an
    abort-mode pause, and runs once a push reaches the version; one can still be aborted."""
    d = Driver(llm)
    v0 = llm.get_weight_version()
    core = llm.client.core
    d.add("later", prompts[0], greedy(6, min_weight_version=v0 + 1))
    d.add("never", prompts[1], greedy(6, min_weight_version=v0 + 50))
    d.add("now", prompts[2], greedy(6, min_weight_version=v0))
    d.run(lambda: d.finished("now"))
    assert d.latest["now"].outputs[0].weight_versions == [v0] * 6
    assert "later" not in d.latest and core.kv.block_ids("later") == []
    assert llm.get_stats()["num_waiting"] == 2
    llm.pause_generation(mode="abort")  # (a trainer's pause before the push they wait for)
    llm.reload_weights(version=v0 + 1)
    llm.resume_generation()
    d.run(lambda: d.finished("later"))
    assert d.latest["later"].outputs[0].weight_versions == [v0 + 1] * 6
    assert d.latest["later"].outputs[0].finish_reason == "length"
    assert "never" in core.scheduler.requests and core.kv.block_ids("never") == []
    llm.client.abort_requests(["never"])
    d.step()
    assert d.latest["never"].outputs[0].finish_reason == "abort" and d.tokens("never") == []
    assert "never" not in core.scheduler.requests and llm.get_stats()["num_waiting"] == 0


def test_a_chunked_update_counts_once_with_its_final_version(llm, prompts):
    """During a keep pause an update in two chunks passes through v+1 and v+2 and is then
    relabelled v+1 (vLLM's finish_weight_update): a request allowed 1 version survives it."""
    d = Driver(llm)
    v0 = llm.get_weight_version()
    d.add("one", prompts[0], greedy(20, max_weight_staleness=1))
    d.add("zero", prompts[1], greedy(20, max_weight_staleness=0))
    d.run(lambda: len(d.tokens("one")) >= 2 and len(d.tokens("zero")) >= 2)
    llm.pause_generation(mode="keep")
    llm.reload_weights(version=v0 + 1)
    llm.reload_weights(version=v0 + 2)
    llm.set_weight_version(v0 + 1, above=v0)
    llm.resume_generation()
    d.run(lambda: d.finished("one", "zero"))
    assert d.latest["zero"].outputs[0].finish_reason == "stale"
    one = d.latest["one"].outputs[0]
    assert one.finish_reason == "length" and one.weight_versions[-1] == v0 + 1
    llm.set_weight_version(v0 + 3)  # (the next test starts above every version used here)


def test_offline_generate_refuses_a_version_nothing_can_push(llm, prompts):
    """LLM.generate blocks until its requests end: one waiting for a future version would hang."""
    v = llm.get_weight_version()
    with pytest.raises(InvalidRequestError, match="min_weight_version") as e:
        llm.generate(prompts[0], greedy(2, min_weight_version=v + 1), use_tqdm=False)
    assert e.value.param == "min_weight_version"
    out = llm.generate(prompts[0], greedy(2, min_weight_version=v), use_tqdm=False)[0]
    assert out.outputs[0].weight_versions == [v, v]
