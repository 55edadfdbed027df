"""Async scheduling (EngineConfig.async_scheduling): step N+1 is scheduled while step N runs, its
decodes read N's samples as placeholders. Requests must end with the same tokens and finish
reasons as with one step at a time, through chunked prefill, preemption, stop tokens, max_tokens,
the context limit and streaming input; then the same through the real engine against itself.

The scheduler tests drive it with a stand-in worker whose "model" is a fixed function of (request,
position, input token), so a token sequence is fully determined by its prompt whatever the
batching, and a placeholder the worker fills wrongly changes everything after it.
"""
import random
import threading
import time
import zlib

import pytest

from engine import LLM, SamplingParams
from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.protocol import EngineCoreRequest, StreamInput
from engine.step_io import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput

EOS = 2


class StandInWorker:
    """Samples token f(request, position, input token) for every row that samples; fills a
    placeholder from its own last output, as engine/worker/model_runner.py does."""

    def __init__(self, eos_every: int):
        self.eos_every = eos_every
        self.last_sampled: dict[str, int] = {}

    def token(self, rid: str, pos: int, tok: int) -> int:
        h = zlib.crc32(f"{rid} {pos} {tok}".encode())  # (str hashes differ between processes)
        return EOS if h % self.eos_every == 0 else 3 + h % 50

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        sampled = {}
        for sr in so.scheduled:
            assert PLACEHOLDER_TOKEN not in sr.token_ids[:-1], "a placeholder is only ever a decode's one token"
            tokens = list(sr.token_ids)
            if tokens[-1] == PLACEHOLDER_TOKEN:
                assert len(tokens) == 1
                tokens[-1] = self.last_sampled[sr.request_id]
            if sr.sample:
                t = self.token(sr.request_id, sr.start + len(tokens) - 1, tokens[-1])
                if sr.banned_token_ids and t in sr.banned_token_ids:
                    t = 3
                sampled[sr.request_id] = t
        self.last_sampled = sampled
        return ModelRunnerOutput(sampled=sampled)


def make_scheduler(rng: random.Random) -> Scheduler:
    num_blocks = rng.randint(16, 40)  # 4 tokens each: preemptions are frequent
    kv = KVCacheManager(num_blocks, 4, rng.random() < 0.7)
    return Scheduler(kv, max_num_seqs=rng.randint(2, 8), max_num_batched_tokens=rng.randint(12, 48),
                     max_model_len=min(rng.randint(40, 60), 4 * num_blocks))


def make_requests(rng: random.Random, n: int) -> list[tuple[int, EngineCoreRequest, list[list[int]]]]:
    """(step to arrive at, request, its later input chunks) for n requests."""
    shared = [rng.randint(3, 60) for _ in range(8)]  # a common prefix for prefix-cache hits
    out = []
    for i in range(n):
        prompt = (shared[:rng.randint(0, 8)] if rng.random() < 0.5 else []) + [
            rng.randint(3, 60) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, 12)
        params = SamplingParams(max_tokens=max_tokens, min_tokens=min(max_tokens, rng.choice([0, 0, 2])),
                                ignore_eos=rng.random() < 0.2, stop_token_ids=rng.choice([None, [7, 11]]))
        streaming = rng.random() < 0.3
        chunks = [[rng.randint(3, 60) for _ in range(rng.randint(0, 4))] for _ in range(rng.randint(1, 3))] \
            if streaming else []
        out.append((rng.randint(0, 10), EngineCoreRequest(f"r{i}", prompt, params, EOS, streaming=streaming), chunks))
    return out


def run(seed: int, depth: int, stats: bool = False):
    """Every request's tokens and finish reason (and the number of preemptions with `stats`),
    stepping with `depth` steps in flight (1: one
    at a time). Requests arrive at fixed step counts; a streaming request gets its next chunk as
    soon as its last one ended (its output said so), the final one closing it."""
    rng = random.Random(seed)
    sched, worker = make_scheduler(rng), StandInWorker(eos_every=rng.choice([5, 9, 1000]))
    arrivals = make_requests(rng, 14)
    chunks = {req.request_id: list(c) for _, req, c in arrivals}
    requests: dict[str, Request] = {}
    in_flight: list[SchedulerOutput] = []
    steps = 0
    while arrivals or sched.has_unfinished() or in_flight:
        for item in [a for a in arrivals if a[0] <= steps]:
            arrivals.remove(item)
            requests[item[1].request_id] = Request(item[1])
            sched.add_request(requests[item[1].request_id])
        so = sched.schedule() if sched.can_step() else None
        outputs = []
        if depth == 1 and so is not None:
            outputs = sched.update_from_output(so, worker.execute(so), 0)
        elif depth == 2:
            if in_flight:  # the step in flight finishes; the new one starts; then the old outputs apply
                last = in_flight.pop()
                result = worker.execute(last)
                if so is not None:
                    in_flight.append(so)
                outputs = sched.update_from_output(last, result, 0)
            elif so is not None:
                in_flight.append(so)
        for o in outputs:
            req = requests[o.request_id]
            if o.resumable and chunks[o.request_id] and \
                    req.num_tokens + len(chunks[o.request_id][0]) < sched.max_model_len:  # (the core checks that)
                chunk = chunks[o.request_id].pop(0)
                sched.add_stream_input(requests[o.request_id],
                                       StreamInput(o.request_id, chunk, final=not chunks[o.request_id]))
            elif o.resumable:
                sched.add_stream_input(requests[o.request_id], StreamInput(o.request_id, [], final=True))
        steps += 1
        assert steps < 2000, "no progress"
    kv = sched.kv
    assert kv.num_free_blocks == kv.num_blocks and kv.req_blocks == {}
    assert all(r.num_placeholders == 0 for r in requests.values())
    results = {rid: (r.all_token_ids, None if r.finish_reason is None else r.finish_reason.name)
               for rid, r in requests.items()}
    return (results, sched.num_preemptions) if stats else results


@pytest.mark.parametrize("seed", range(40))
def test_two_steps_in_flight_give_every_request_the_same_tokens(seed):
    one_at_a_time = run(seed, depth=1)
    assert run(seed, depth=2) == one_at_a_time


def test_the_runs_exercise_what_they_claim():
    """The random configurations above preempt, stop on EOS and stop ids, end on max_tokens, and
    stream chunks (else the comparison would prove little)."""
    reasons, preemptions, streamed = set(), 0, 0
    for seed in range(40):
        results, n = run(seed, depth=2, stats=True)
        preemptions += n
        reasons |= {reason for _, reason in results.values()}
        streamed += sum(1 for _, req, _ in make_requests(random.Random(seed), 14) if req.streaming)
    assert {"STOP", "LENGTH"} <= reasons and preemptions > 10 and streamed > 20


# ---- the real engine ----------------------------------------------------------------------------
def _requests(seed: int = 0) -> list[tuple[list[int], SamplingParams]]:
    """Prompts (a shared prefix for some) and params: greedy with logprobs, stop ids, seeded
    sampling, prompt logprobs, n=2."""
    rng = random.Random(seed)
    prefix = [rng.randint(100, 40000) for _ in range(20)]
    out = []
    for i in range(14):
        prompt = (prefix if i % 3 == 0 else []) + [rng.randint(100, 40000) for _ in range(rng.randint(2, 40))]
        kw = dict(max_tokens=rng.randint(4, 24), logprobs=2, temperature=0.0)
        if i % 4 == 1:
            kw.update(temperature=1.0, seed=1000 + i)
        if i == 5:
            kw.update(prompt_logprobs=1)
        if i == 7:
            kw.update(n=2, temperature=0.8, seed=7)
        out.append((prompt, SamplingParams(**kw)))
    return out


def _generate(llm: LLM, requests) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests], [s for _, s in requests], use_tqdm=False)
    return [[(c.token_ids, c.finish_reason, c.logprobs, c.top_logprobs) for c in o.outputs]
            + [o.prompt_logprobs] for o in outs]


def test_llm_tokens_and_logprobs_are_the_same_with_async_scheduling(tiny_folder, default_model_path):
    """Through the engine-core process: chunked prefill (32-token steps), preemption (a cache of
    a few blocks), prefix hits, stop ids that end requests early (the row step N+1 computed for
    them is dropped), seeded sampling. Batch-invariant mode makes every logprob bit-exact whatever
    the batch, so any row the placeholders got wrong would show."""
    block_bytes = 16 * 2 * 2 * 2 * 16 * 4  # 16 tokens x 2 layers x (K, V) x 2 kv heads x 16 dims x fp32
    cfg = dict(tokenizer=default_model_path, dtype="float32", batch_invariant=True, max_num_batched_tokens=32,
               max_num_seqs=6, kv_cache_memory=16 * block_bytes)
    reqs = _requests()
    sync = LLM(tiny_folder, **cfg)
    try:
        plain = _generate(sync, reqs)
        # stop ids taken from the outputs themselves end several requests early
        stops = [toks[len(toks) // 2] for (toks, *_), *_ in plain[::2] if len(toks) > 2]
        reqs = [(p, SamplingParams(**{**{f: getattr(s, f) for f in ("max_tokens", "logprobs", "temperature", "seed",
                                                                     "prompt_logprobs", "n")},
                                      "stop_token_ids": stops})) for p, s in reqs]
        expected = _generate(sync, reqs)
        preemptions = sync.get_stats()["num_preemptions"]
    finally:
        sync.shutdown()
    assert preemptions > 0, "the cache is meant to be too small for the batch"
    assert sum(o[0][1] == "stop" for o in expected) >= 3, "the stop ids are meant to end requests early"
    overlapped = LLM(tiny_folder, async_scheduling=True, **cfg)
    try:
        assert _generate(overlapped, reqs) == expected
        assert _generate(overlapped, reqs[::-1]) == expected[::-1]  # (other batches, the same bits)
        stats = overlapped.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0
    finally:
        overlapped.shutdown()


def test_in_process_core_with_async_scheduling(tiny_folder, default_model_path):
    """LLM(multiprocess=False): the core steps in this process, a utility call drains the step
    in flight first."""
    reqs = [(p, SamplingParams(max_tokens=s.max_tokens, temperature=0.0)) for p, s in _requests(1)]
    ref = LLM(tiny_folder, tokenizer=default_model_path, dtype="float32", multiprocess=False)
    try:
        expected = _generate(ref, reqs)
    finally:
        ref.shutdown()
    llm = LLM(tiny_folder, tokenizer=default_model_path, dtype="float32", multiprocess=False, async_scheduling=True)
    try:
        assert _generate(llm, reqs) == expected
        assert llm.reset_prefix_cache() and llm.get_stats()["num_running"] == 0
        assert _generate(llm, reqs) == expected
    finally:
        llm.shutdown()


def test_async_scheduling_refuses_what_it_does_not_cover(tmp_path):
    from engine.config import EngineConfig
    from tests.engine.test_tiny_models import build_model

    build_model("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match="async_scheduling does not combine with enable_expert_parallel"):
        EngineConfig(model=str(tmp_path), async_scheduling=True, enable_expert_parallel=True)


def test_async_llm_streaming_input_and_control_calls_with_async_scheduling(default_model_path):
    """The default model behind AsyncLLM with async_scheduling: a 3-turn streaming-input chat
    (each turn fed when the last reply ended: its ending step's successor computed a row that is
    dropped) gives what one request on the whole context gives; then 6 streams run while a
    control loop pauses (keep), clears the prefix cache and resumes over and over, each call
    draining the step in flight, and every stream still gives the plain greedy tokens."""
    import asyncio

    from engine.frontend.async_llm import AsyncLLM, StreamingInput

    greedy = SamplingParams(temperature=0, max_tokens=40)
    llm = AsyncLLM(dtype="float32", async_scheduling=True, max_num_seqs=8)
    tok = llm.tokenizer
    turns = [tok.apply_chat_template([{"role": "user", "content": "Name one yellow fruit. Answer with one word."}],
                                     add_generation_prompt=True, tokenize=False),
             "\n<|im_start|>user\nAnd a red one? One word.<|im_end|>\n<|im_start|>assistant\n",
             "\n<|im_start|>user\nA two-line poem about both.<|im_end|>\n<|im_start|>assistant\n"]
    chunks = [tok.encode(t, add_special_tokens=False) for t in turns]

    async def collect(prompt, params, rid=None):
        last = None
        async for out in llm.generate(prompt, params, request_id=rid):
            last = out
        return last.outputs[0].token_ids

    async def chat():
        refs, context = [], []
        for ids in chunks:
            context += ids
            refs.append(await collect({"prompt_token_ids": list(context)}, greedy))
            context += refs[-1]
        done = asyncio.Event()

        async def inputs():
            for k, ids in enumerate(chunks):
                if k:
                    await done.wait()
                    done.clear()
                yield StreamingInput(ids)
            await done.wait()

        replies, current, reasons = [], [], []
        async for out in llm.generate(inputs(), greedy, request_id="chat"):
            c = out.outputs[0]
            current = c.token_ids[sum(map(len, replies)):]
            if c.finish_reason is not None and (current or not out.finished):
                replies.append(list(current))
                reasons.append(c.finish_reason)
                done.set()
        assert replies == refs
        # short answers: a stop token ended them, before max_tokens (which no placeholder passes)
        assert reasons[:2] == ["stop", "stop"] and max(map(len, replies[:2])) < 39, replies

    async def control_loop(stop: asyncio.Event) -> int:
        n = 0
        while not stop.is_set():
            await llm.pause_generation(mode="keep")
            assert await llm.reset_prefix_cache()
            await llm.resume_generation()
            n += 1
            await asyncio.sleep(0.01)
        return n

    async def streams_under_control_calls():
        prompts = [{"prompt_token_ids": tok.encode(f"Count to {i} in words:")} for i in range(3, 9)]
        refs = [await collect(p, greedy) for p in prompts]
        stop = asyncio.Event()
        calls = asyncio.create_task(control_loop(stop))
        got = await asyncio.gather(*(collect(p, greedy) for p in prompts))
        stop.set()
        assert await calls >= 3
        assert got == refs
        stats = await llm.get_stats()
        assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(chat(), 300))
        loop.run_until_complete(asyncio.wait_for(streams_under_control_calls(), 300))
    finally:
        llm.shutdown()
        loop.run_until_complete(asyncio.sleep(0.05))
        loop.close()


def test_every_control_call_on_the_core_waits_for_the_step_in_flight(tiny_folder, default_model_path):
    """EngineCore used directly (as the core process does): sleep, wake, a weight reload, a pause
    and a cache reset each arrive while a step is in flight; each finishes that step first (sleep
    would otherwise free the KV cache under it), and the requests end as without async scheduling."""
    from engine.config import EngineConfig
    from engine.core.engine_core import Deferred, EngineCore
    from engine.protocol import EngineCoreRequest

    def run_core(async_scheduling: bool) -> dict:
        core = EngineCore(EngineConfig(model=tiny_folder, tokenizer=default_model_path, dtype="float32",
                                       kv_cache_memory=8 << 20, async_scheduling=async_scheduling))
        tokens: dict[str, list[int]] = {}

        def take(outputs):
            for o in outputs:
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

        def settle(result):
            while isinstance(result, Deferred) and not result.done():
                take(core.step())
            return result.finish() if isinstance(result, Deferred) else result

        try:
            for i in range(4):
                core.add_request(EngineCoreRequest(f"r{i}", [5 + i, 6, 7, 8 + i],
                                                   SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), None))
            calls = [(True, lambda: core.sleep(1, "keep")), (False, core.wake_up),
                     (True, core.reset_prefix_cache), (True, lambda: core.pause_generation("keep")),
                     (False, lambda: core.stage_weights("reload", [])), (False, lambda: core.commit_weights(1)),
                     (False, core.resume_generation), (True, lambda: core.collective_rpc("list_loras"))]
            for running, call in calls:
                if running:  # (asleep or paused, a step computes nothing)
                    take(core.step())
                    take(core.step())
                    assert (core._in_flight is not None) == async_scheduling
                settle(call())
                assert core._in_flight is None
                take(core.take_pending_outputs())
            while core.has_work():
                take(core.step())
            return tokens
        finally:
            core.shutdown()

    expected = run_core(False)
    assert sorted(map(len, expected.values())) == [12] * 4
    assert run_core(True) == expected


class ThreadRecorder:
    """A worker extension that says which thread built the worker and which runs a call."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.built_in = threading.current_thread().name

    def threads(self) -> tuple[str, str]:
        return self.built_in, threading.current_thread().name


def test_the_worker_is_built_and_called_in_the_step_thread(tiny_folder, default_model_path):
    """With async scheduling the core's own thread never runs the worker: the load, the steps and
    the control calls all run in the step thread (on a CPU a second thread running torch ops
    keeps a second OpenMP team, which slows every step); a Deferred's helper thread (a weight
    group forming, which may wait for seconds) calls in place instead of queueing behind steps."""
    from engine.config import EngineConfig
    from engine.core.engine_core import Deferred, EngineCore

    core = EngineCore(EngineConfig(model=tiny_folder, tokenizer=default_model_path, dtype="float32",
                                   kv_cache_memory=8 << 20, async_scheduling=True,
                                   worker_extension_cls="tests.engine.test_async_scheduling:ThreadRecorder"))
    try:
        core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8), None))
        core.step()
        assert core._in_flight is not None
        built_in, called_in = core.collective_rpc("threads")[0]
        assert built_in == called_in and built_in.startswith("engine-step")
        assert called_in != threading.current_thread().name
        beside = Deferred.in_thread(lambda: core.executor.collective_rpc("threads")[0][1], "weight-group")
        while not beside.done():
            time.sleep(0.01)
        assert beside.finish() == "weight-group"
    finally:
        core.shutdown()


class LaunchRecorder:
    """A worker extension that logs each step's launch and read-back. A read-back waits (up to a
    second) for the next step's launch: the core queues step N+1 before it reads step N back, so
    the step thread launches N+1 meanwhile (its placeholder tokens gathered on the device)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log: list[tuple[str, int]] = []
        self.launched = threading.Condition()

    def launch_model(self, scheduler_output):
        n = sum(1 for kind, _ in self.log if kind == "launch")
        with self.launched:
            self.log.append(("launch", n))
            self.launched.notify_all()
        finish = super().launch_model(scheduler_output)

        def read_back():
            with self.launched:
                self.launched.wait_for(lambda: ("launch", n + 1) in self.log, timeout=1.0)
            self.log.append(("read", n))
            return finish()
        return read_back

    def step_log(self) -> list[tuple[str, int]]:
        return list(self.log)


def test_the_next_step_is_launched_before_the_last_one_is_read_back(tiny_folder, default_model_path):
    """Step N+1 is launched while step N's samples are still on their way to the host (on a GPU
    the two steps' kernels then run back to back), and the tokens are those of one step at a time."""
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore

    def run(async_scheduling: bool) -> tuple[list[int], list[tuple[str, int]]]:
        core = EngineCore(EngineConfig(model=tiny_folder, tokenizer=default_model_path, dtype="float32",
                                       kv_cache_memory=8 << 20, async_scheduling=async_scheduling,
                                       worker_extension_cls="tests.engine.test_async_scheduling:LaunchRecorder"))
        try:
            core.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6,
                                                                              ignore_eos=True), None))
            tokens = []
            while core.has_work():
                tokens += [t for o in core.step() for t in o.new_token_ids]
            return tokens, core.collective_rpc("step_log")[0]
        finally:
            core.shutdown()

    expected, _ = run(False)
    tokens, log = run(True)
    assert tokens == expected and len(tokens) == 6
    reads = [n for kind, n in log if kind == "read"]
    assert reads == list(range(len(reads)))
    for n in reads:
        if ("launch", n + 1) in log:
            assert log.index(("launch", n + 1)) < log.index(("read", n)), log


class FailsToLoad:
    """A worker extension whose worker cannot be built."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("no weights here")


def test_a_worker_that_fails_to_load_leaves_no_step_thread(tiny_folder, default_model_path):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore

    with pytest.raises(RuntimeError, match="no weights here"):
        EngineCore(EngineConfig(model=tiny_folder, tokenizer=default_model_path, dtype="float32",
                                kv_cache_memory=8 << 20, async_scheduling=True,
                                worker_extension_cls="tests.engine.test_async_scheduling:FailsToLoad"))
    assert not [t for t in threading.enumerate() if t.name.startswith("engine-step")]
