"""apply_model and wait_for_requests_to_drain, two frontend verbs of vLLM's, on a tiny random Llama.

- apply_model: vLLM's `LLM.apply_model(func)` -> `collective_rpc("apply_model", args=(func,))`
  -> `WorkerBase.apply_model(fn)` = `fn(self.get_model())`, one result per worker
  (vllm/entrypoints/llm.py, vllm/v1/engine/llm_engine.py, vllm/v1/worker/worker_base.py). vLLM
  pickles the function; our wire never carries code, so it travels as its import path, resolved
  as vLLM resolves `worker_extension_cls` (resolve_obj_by_qualname): a lambda or a closure is
  refused with the reason.
- wait_for_requests_to_drain: vLLM's `AsyncLLM.wait_for_requests_to_drain(drain_timeout: int = 300)`
  (vllm/v1/engine/async_llm.py): returns once nothing is in flight, TimeoutError past the timeout.
"""
import asyncio
import os
from pathlib import Path

import pytest
import torch

from engine import LLM, InvalidRequestError, SamplingParams
from engine.frontend.async_llm import AsyncLLM
from engine.worker.functions import function_path
from tests.engine import model_fns
from weight_sync import load_safetensors_folder

REPO_ROOT = Path(__file__).resolve().parents[2]


def _closure():
    def inner(model):
        return 0

    return inner


class _Holder:
    def method(self, model):
        return 0


def run(loop, coro, timeout: float = 300):  # a hang guard, not a speed limit
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def allm(loop, tiny_folder, default_model_path):
    """An AsyncLLM whose engine core (a fresh interpreter) imports tests.engine.model_fns."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), saved) if p)
    llm = AsyncLLM(tiny_folder, tokenizer=default_model_path, dtype="float32", kv_cache_memory=32 << 20)
    yield llm
    llm.shutdown()
    loop.run_until_complete(asyncio.sleep(0.05))
    if saved is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = saved


def test_apply_model_runs_a_function_on_every_worker(loop, allm, tiny_folder):
    """One result per worker (one worker here), whichever way the function is named."""
    assert run(loop, allm.apply_model(model_fns.num_layers)) == [2]
    for path in ("tests.engine.model_fns:num_layers", "tests.engine.model_fns.num_layers"):
        assert run(loop, allm.apply_model(path)) == [2]
    assert run(loop, allm.apply_model(model_fns.Probes.hidden_size)) == [64]
    [summary] = run(loop, allm.apply_model(model_fns.embedding_summary))  # a tensor travels back
    assert summary["shape"] == [49152, 64] and summary["dtype"] == "float32"
    row0 = next(t for n, t in load_safetensors_folder(tiny_folder) if n == "model.embed_tokens.weight")[0]
    assert isinstance(summary["row0"], torch.Tensor) and torch.equal(summary["row0"], row0)


def test_apply_model_takes_no_code(loop, allm):
    for fn, words in [(lambda model: 0, "lambda or a closure"), (_closure(), "lambda or a closure"),
                      (_Holder().method, "not reachable"), (3, "module-level function")]:
        with pytest.raises(InvalidRequestError, match=words):
            run(loop, allm.apply_model(fn))
    for path, words in [("tests.engine.model_fns:no_such_fn", "cannot be imported"),
                        ("no_such_module:fn", "cannot be imported"), ("nodots", "not an import path"),
                        ("tests.engine.model_fns:Probes", "not a function")]:
        with pytest.raises(InvalidRequestError, match=words) as e:  # raised in the engine core, typed here
            run(loop, allm.apply_model(path))
        assert e.value.param == "fn"
    assert run(loop, allm.apply_model(model_fns.num_layers)) == [2]  # the engine serves on


def test_apply_model_in_process(tiny_folder, default_model_path):
    llm = LLM(tiny_folder, tokenizer=default_model_path, dtype="float32", multiprocess=False, kv_cache_memory=16 << 20)
    try:
        assert llm.apply_model(model_fns.num_layers) == [2]
        with pytest.raises(InvalidRequestError, match="__main__"):
            llm.apply_model(_main_function())
    finally:
        llm.shutdown()


def _main_function():
    """A function as a script's `def` at its top level looks (other processes cannot import it)."""
    def fn(model):
        return 0

    fn.__module__, fn.__qualname__ = "__main__", "fn"
    return fn


def test_function_paths():
    assert function_path(model_fns.num_layers) == "tests.engine.model_fns:num_layers"
    assert function_path(model_fns.Probes.hidden_size) == "tests.engine.model_fns:Probes.hidden_size"
    assert function_path("any.string:as_is") == "any.string:as_is"


def test_wait_for_requests_to_drain(loop, allm):
    # near the tiny model's context (256): the pause after the first output finds them all running, on
    # a fast machine too
    params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)

    async def scenario():
        first = asyncio.Event()
        finals = {}

        async def consume(i):
            async for out in allm.generate([1, 2, 3 + i], params, request_id=f"drain-{i}"):
                first.set()
                finals[i] = out

        assert (await asyncio.wait_for(allm.wait_for_requests_to_drain(1), 5)) is None  # nothing in flight
        tasks = [asyncio.ensure_future(consume(i)) for i in range(4)]
        await asyncio.wait_for(first.wait(), 60)
        await allm.pause_generation(mode="keep")  # frozen: they cannot finish until the resume
        with pytest.raises(TimeoutError, match="drain"):
            await allm.wait_for_requests_to_drain(drain_timeout=0.3)
        assert all(allm.has_request(f"drain-{i}") for i in range(4))
        await allm.resume_generation()
        await allm.wait_for_requests_to_drain(drain_timeout=60)
        assert not any(allm.has_request(f"drain-{i}") for i in range(4))
        await asyncio.gather(*tasks)
        assert all(finals[i].finished and len(finals[i].outputs[0].token_ids) == params.max_tokens
                   for i in range(4))

    run(loop, scenario())
