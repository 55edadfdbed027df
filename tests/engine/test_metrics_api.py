"""get_metrics() and do_log_stats() on LLM and AsyncLLM: the engine core's series under the names
/metrics uses, and the frontend's request histograms and counters, consistent with what ran."""
import asyncio
import logging

from engine import LLM, AsyncLLM, SamplingParams
from engine.frontend.metrics import ENGINE_GAUGES, PREFIX, Counter, Gauge, Histogram


def by_name(metrics) -> dict:
    out = {}
    for m in metrics:
        key = m.name + "".join(f"{{{k}={v}}}" for k, v in sorted(m.labels.items()))
        out[key] = m
    return out


def check(metrics, outs):
    m = by_name(metrics)
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert isinstance(m[f"{PREFIX}_num_requests_running"], Gauge)
    assert {f"{PREFIX}_{name}" for k, (name, _) in ENGINE_GAUGES.items()
            if k != "num_replicas_alive" and not k.startswith("encoder_cache")} <= set(m)  # (VLMs only)
    assert m[f"{PREFIX}_generation_tokens"].value == generated  # the core's count
    assert isinstance(m[f"{PREFIX}_completion_tokens"], Counter) and m[f"{PREFIX}_completion_tokens"].value == generated
    assert m[f"{PREFIX}_prompt_tokens"].value == sum(len(o.prompt_token_ids) for o in outs)
    ttft = m[f"{PREFIX}_time_to_first_token_seconds"]
    assert isinstance(ttft, Histogram) and ttft.count == len(outs) and ttft.buckets["+Inf"] == len(outs)
    assert list(ttft.buckets.values()) == sorted(ttft.buckets.values())  # cumulative
    e2e = m[f"{PREFIX}_e2e_request_latency_seconds"]
    assert e2e.count == len(outs) and e2e.sum >= ttft.sum > 0
    assert m[f"{PREFIX}_requests_finished{{finish_reason=length}}"].value == len(outs)


def test_llm_get_metrics_and_log_stats(tiny_folder, default_model_path, caplog):
    llm = LLM(tiny_folder, tokenizer=default_model_path, multiprocess=False)
    try:
        outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        check(llm.get_metrics(), outs)
        with caplog.at_level(logging.INFO, logger="engine"):
            line = llm.do_log_stats()
        assert "running 0, waiting 0" in line and "weights v0" in line and line in caplog.text
    finally:
        llm.shutdown()


def test_async_llm_get_metrics_and_periodic_log_stats(tiny_folder, default_model_path, caplog):
    async def main():
        llm = AsyncLLM(tiny_folder, tokenizer=default_model_path, log_stats_interval_s=0.05)
        try:
            outs = []
            for i, prompt in enumerate(([5, 6, 7], [8, 9, 10, 11])):
                async for out in llm.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), f"r{i}"):
                    pass
                outs.append(out)
            await asyncio.sleep(0.3)
            check(await llm.get_metrics(), outs)
        finally:
            llm.shutdown()

    with caplog.at_level(logging.INFO, logger="engine"):
        asyncio.run(main())
    assert caplog.text.count("engine stats:") >= 2  # the periodic lines
