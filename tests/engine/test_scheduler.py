"""Scheduler + KVCacheManager without a model: steps are simulated by handing every request
that caught up with its tokens a made-up sampled token."""
import itertools

import pytest

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.protocol import EngineCoreRequest, FinishReason
from engine.sampling_params import SamplingParams
from engine.step_io import ModelRunnerOutput

EOS = 2
_ids = itertools.count()


def make_request(num_prompt_tokens=None, tokens=None, eos=EOS, **params) -> Request:
    if tokens is None:
        start = 1000 * (next(_ids) + 1)
        tokens = list(range(start, start + num_prompt_tokens))
    params.setdefault("max_tokens", 4)
    return Request(EngineCoreRequest(f"r{next(_ids)}", tokens, SamplingParams(**params), eos))


def make_scheduler(num_blocks=100, block_size=4, max_num_seqs=16, budget=64, max_model_len=1000, caching=True):
    kv = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len)


def step(sched: Scheduler, token=7):
    """schedule -> pretend to run -> update. Returns (scheduled {id: n}, output, finished ids)."""
    out = sched.schedule()
    sampled = {r.request_id: token for r in out.scheduled if r.sample}
    for r in out.scheduled:
        req = sched.requests[r.request_id]
        assert r.start + len(r.token_ids) == req.num_computed_tokens  # counted when scheduled
        assert r.token_ids == req.all_token_ids[r.start:r.start + len(r.token_ids)]
        assert r.sample == (r.start + len(r.token_ids) == req.num_tokens), "sample exactly at the last token"
        assert r.block_ids == sched.kv.block_ids(r.request_id)
    outputs = sched.update_from_output(out, ModelRunnerOutput(sampled=sampled), weight_version=0)
    assert {o.request_id for o in outputs} == set(sampled)
    return ({r.request_id: len(r.token_ids) for r in out.scheduled}, out,
            [o.request_id for o in outputs if o.finished])


def run_to_completion(sched: Scheduler, max_steps=1000):
    steps = []
    while sched.has_unfinished():
        steps.append(step(sched))
        assert len(steps) < max_steps, "scheduler does not make progress"
    return steps


def check_pool_idle(sched: Scheduler):
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.blocks)


# ---- chunked prefill ------------------------------------------------------------------------
def test_chunked_prefill_alone_takes_ceil_prompt_over_budget_steps():
    sched = make_scheduler(budget=32)
    a = make_request(100, max_tokens=3)
    sched.add_request(a)
    chunks = []
    while a.num_output_tokens == 0:
        scheduled, out, _ = step(sched)
        assert out.total_num_scheduled_tokens <= 32
        chunks.append(scheduled[a.request_id])
    assert chunks == [32, 32, 32, 4]
    assert a.num_computed_tokens == 100 and a.num_tokens == 101
    steps = run_to_completion(sched)
    assert [s[0] for s in steps] == [{a.request_id: 1}, {a.request_id: 1}]
    assert a.finish_reason == FinishReason.LENGTH and a.num_output_tokens == 3
    check_pool_idle(sched)


def test_chunked_prefill_mixes_decodes_of_other_requests():
    sched = make_scheduler(budget=32)
    b = make_request(5, max_tokens=50)
    sched.add_request(b)
    step(sched)  # b's prefill
    assert b.num_output_tokens == 1
    a = make_request(100, max_tokens=2)
    sched.add_request(a)
    prefill_steps = 0
    while a.num_output_tokens == 0:
        scheduled, out, _ = step(sched)
        prefill_steps += 1
        assert out.total_num_scheduled_tokens <= 32
        assert scheduled[b.request_id] == 1, "the running decode must be in every step"
        assert scheduled[a.request_id] > 1
        assert list(scheduled)[0] == b.request_id  # running requests first
    assert prefill_steps == 4  # 31 + 31 + 31 + 7
    assert a.num_computed_tokens == 100
    assert b.num_output_tokens == 5


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2, budget=1000)
    reqs = [make_request(6, max_tokens=3) for _ in range(5)]
    for r in reqs:
        sched.add_request(r)
    seen_running = []
    while sched.has_unfinished():
        scheduled, _, _ = step(sched)
        assert len(scheduled) <= 2
        assert len(sched.running) <= 2
        seen_running.append(len(sched.running))
    assert max(seen_running) == 2
    assert all(r.num_output_tokens == 3 and r.finish_reason == FinishReason.LENGTH for r in reqs)
    check_pool_idle(sched)


def test_requests_are_admitted_in_arrival_order():
    sched = make_scheduler(max_num_seqs=1, budget=1000)
    reqs = [make_request(3, max_tokens=2) for _ in range(3)]
    for r in reqs:
        sched.add_request(r)
    order = []
    for s, _, _ in run_to_completion(sched):
        for rid in s:
            if rid not in order:
                order.append(rid)
    assert order == [r.request_id for r in reqs]


# ---- preemption -----------------------------------------------------------------------------
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_when_blocks_run_out(caching):
    # 6 blocks of 4 tokens; two requests of 8 prompt tokens and 10 outputs each need 5 blocks
    # apiece at the end, so the pool cannot hold both.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=caching)
    a = make_request(8, max_tokens=10)
    b = make_request(8, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    scheduled, _, _ = step(sched)
    assert scheduled == {a.request_id: 8, b.request_id: 8}
    preempted_at = None
    while sched.has_unfinished():
        b_blocks_before = sched.kv.block_ids(b.request_id)
        scheduled, out, _ = step(sched)
        if out.num_preempted and preempted_at is None:
            preempted_at = b.num_output_tokens
            assert b.status == RequestStatus.PREEMPTED  # the most recently admitted one
            assert b.num_computed_tokens == 0
            assert b.request_id not in scheduled
            assert sched.kv.block_ids(b.request_id) == []
            assert sched.waiting[0] is b
            assert a.status == RequestStatus.RUNNING and a.request_id in scheduled
            # b's blocks went back to the pool (a took one of them)
            assert sched.kv.num_free_blocks == 6 - len(sched.kv.block_ids(a.request_id))
            assert set(b_blocks_before) & set(sched.kv.block_ids(a.request_id))
        for r in (a, b):
            if not r.is_finished:
                assert len(sched.kv.block_ids(r.request_id)) * 4 >= r.num_computed_tokens
    assert preempted_at is not None and 0 < preempted_at < 10
    assert sched.num_preemptions >= 1 and sched.stats().num_preemptions == sched.num_preemptions
    for r in (a, b):
        assert r.finish_reason == FinishReason.LENGTH
        assert r.num_output_tokens == 10
        assert r.all_token_ids[8:] == [7] * 10
    check_pool_idle(sched)


def test_preempted_request_resumes_with_recompute():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, caching=False)
    a = make_request(8, max_tokens=10)
    b = make_request(8, max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    while b.status != RequestStatus.PREEMPTED:
        step(sched)
    tokens_at_preemption = b.num_tokens
    while b.num_computed_tokens == 0:
        scheduled, _, _ = step(sched)
    # first step after resuming: the whole sequence so far is recomputed (no cache to hit)
    assert scheduled[b.request_id] == tokens_at_preemption
    assert b.num_cached_tokens == 0
    run_to_completion(sched)
    assert b.num_output_tokens == 10


# ---- abort ----------------------------------------------------------------------------------
def test_abort_frees_blocks():
    sched = make_scheduler(num_blocks=20, max_num_seqs=1)
    a = make_request(10, max_tokens=100)
    w = make_request(10, max_tokens=100)
    sched.add_request(a)
    sched.add_request(w)
    step(sched)
    step(sched)
    assert sched.kv.num_free_blocks < 20
    aborted = sched.abort([a.request_id, w.request_id, "no-such-request"])
    assert [r.request_id for r in aborted] == [a.request_id, w.request_id]
    for r in (a, w):
        assert r.status == RequestStatus.FINISHED and r.finish_reason == FinishReason.ABORT
    assert not sched.has_unfinished() and not sched.running and not sched.waiting
    check_pool_idle(sched)
    out = sched.schedule()
    assert out.scheduled == [] and out.finished_req_ids == [a.request_id, w.request_id]


def test_abort_while_step_runs_is_ignored_by_update():
    sched = make_scheduler()
    a = make_request(10, max_tokens=5)
    sched.add_request(a)
    out = sched.schedule()
    sched.abort([a.request_id])
    assert sched.update_from_output(out, ModelRunnerOutput(sampled={a.request_id: 7}), 0) == []
    assert a.num_output_tokens == 0 and a.finish_reason == FinishReason.ABORT
    check_pool_idle(sched)


# ---- finish rules (Request.append_token) ----------------------------------------------------
def feed(req: Request, tokens, max_model_len=1000):
    """Append tokens until one finishes the request; returns how many were appended."""
    for i, t in enumerate(tokens, 1):
        if req.append_token(t, max_model_len):
            return i
    return None


def test_max_tokens_finishes_with_length():
    r = make_request(3, max_tokens=4)
    assert feed(r, [5] * 10) == 4
    assert r.finish_reason == FinishReason.LENGTH and r.stop_reason is None


def test_eos_finishes_with_stop():
    r = make_request(3, max_tokens=10)
    assert feed(r, [5, 6, EOS, 5]) == 3
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == EOS


def test_stop_token_ids_finish_with_stop():
    r = make_request(3, max_tokens=10, stop_token_ids=[42, 43])
    assert feed(r, [5, 43, 5]) == 2
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == 43


def test_min_tokens_suppresses_early_stop():
    r = make_request(3, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    assert feed(r, [EOS, 42, EOS]) == 3  # the 3rd output token may stop
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == EOS
    r = make_request(3, max_tokens=10, min_tokens=3)
    assert feed(r, [EOS, EOS, 5, 5, EOS]) == 5


def test_ignore_eos_keeps_going_but_stop_token_ids_still_stop():
    r = make_request(3, max_tokens=6, ignore_eos=True)
    assert feed(r, [EOS] * 10) == 6
    assert r.finish_reason == FinishReason.LENGTH
    r = make_request(3, max_tokens=6, ignore_eos=True, stop_token_ids=[42])
    assert feed(r, [EOS, EOS, 42]) == 3
    assert r.finish_reason == FinishReason.STOP and r.stop_reason == 42


def test_no_eos_token_id_means_no_eos_stop():
    r = make_request(3, eos=None, max_tokens=5)
    assert feed(r, [EOS] * 10) == 5
    assert r.finish_reason == FinishReason.LENGTH


def test_max_model_len_finishes_with_length():
    r = make_request(3, max_tokens=None)
    assert feed(r, [5] * 100, max_model_len=10) == 7
    assert r.finish_reason == FinishReason.LENGTH and r.num_tokens == 10


def test_finish_rules_through_the_scheduler():
    sched = make_scheduler()
    stop = make_request(4, max_tokens=10, stop_token_ids=[7])  # step() always samples 7
    length = make_request(4, max_tokens=3)
    sched.add_request(stop)
    sched.add_request(length)
    _, _, finished = step(sched)
    assert finished == [stop.request_id]
    assert stop.finish_reason == FinishReason.STOP and stop.stop_reason == 7
    run_to_completion(sched)
    assert length.finish_reason == FinishReason.LENGTH and length.num_output_tokens == 3
    check_pool_idle(sched)


def test_a_request_whose_lora_adapter_has_no_slot_waits():
    """max_loras 2: the running requests use at most two adapters, pinned ones counted (they keep
    their slot). A request for a third waits until every running request of one adapter is done;
    requests behind it that would keep an unpinned adapter's slot busy wait too (so it cannot
    starve), base-model requests pass it."""

    def with_lora(lora_id: int, max_tokens: int) -> Request:
        return Request(EngineCoreRequest(f"r{next(_ids)}", [1, 2, 3], SamplingParams(max_tokens=max_tokens), EOS,
                                         lora_id=lora_id))

    sched = Scheduler(KVCacheManager(100, 4, True), 16, 64, 1000, max_loras=2)
    a, b, c, a2, base = with_lora(1, 2), with_lora(2, 4), with_lora(3, 2), with_lora(1, 2), with_lora(0, 2)
    for r in (a, b, c, a2, base):
        sched.add_request(r)
    order = [set(step(sched)[0]) for _ in range(5)]
    assert order == [{a.request_id, b.request_id, base.request_id}, {a.request_id, b.request_id, base.request_id},
                     {b.request_id, c.request_id}, {b.request_id, c.request_id}, {a2.request_id}]
    run_to_completion(sched)
    check_pool_idle(sched)

    sched.pinned_loras.add(1)  # adapter 1 keeps a slot: 2 and 3 take turns in the other
    reqs = [with_lora(lora_id, 2) for lora_id in (2, 3, 1, 2, 3, 1)]
    for r in reqs:
        sched.add_request(r)
    while sched.has_unfinished():
        out = sched.schedule()
        used = {sched.requests[s.request_id].lora_id for s in out.scheduled}
        assert len(used | sched.pinned_loras) <= 2, used
        sampled = {s.request_id: 7 for s in out.scheduled if s.sample}
        sched.update_from_output(out, ModelRunnerOutput(sampled=sampled), weight_version=0)
    assert all(r.is_finished for r in reqs)
    check_pool_idle(sched)
