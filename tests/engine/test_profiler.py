"""start_profile / stop_profile: a torch-profiler trace of the engine core with the step's phases
labelled, refused without a folder; off, the phases are a shared no-op."""
import json

import pytest

from engine import LLM, EngineStateError, SamplingParams
from engine.worker import profiler

PHASES = ("schedule", "prepare_inputs", "forward", "compute_logits", "sample", "outputs")


@pytest.mark.parametrize("async_scheduling", [False, True])  # (True: the worker's phases run in a thread of their own)
def test_a_trace_names_the_step_phases(tiny_folder, default_model_path, tmp_path, async_scheduling):
    llm = LLM(tiny_folder, tokenizer=default_model_path, multiprocess=False, profiler_dir=str(tmp_path / "traces"),
              async_scheduling=async_scheduling)
    try:
        assert profiler.phase("forward") is profiler.phase("sample")  # off: one shared no-op
        assert llm.start_profile() is True
        with pytest.raises(EngineStateError, match="already recording"):
            llm.start_profile()
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, prompt_logprobs=1), use_tqdm=False)
        paths = llm.stop_profile()
        assert len(paths) == 1 and paths[0].endswith(".pt.trace.json") and paths[0].startswith(str(tmp_path))
        names = {e.get("name") for e in json.loads(open(paths[0]).read())["traceEvents"]}
        assert set(PHASES) <= names, set(PHASES) - names
        assert profiler.phase("forward") is profiler.phase("sample")  # off again after the stop
        with pytest.raises(EngineStateError, match="no profile is recording"):
            llm.stop_profile()
        # the engine serves on
        assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_profiling_is_refused_without_a_folder(tiny_folder, default_model_path):
    llm = LLM(tiny_folder, tokenizer=default_model_path, multiprocess=False)
    try:
        with pytest.raises(EngineStateError, match="profiling is off"):
            llm.start_profile()
    finally:
        llm.shutdown()
