"""AsyncLLM: the online engine. The engine core runs in its own process; this asyncio frontend
tokenizes, detokenizes, applies stop strings, fans n > 1 out and back in, and streams
RequestOutputs to per-request collectors fed by one output-handler task.

    llm = AsyncLLM()
    async for out in llm.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text)

Streaming input: pass an async generator of StreamingInput instead of a prompt; each chunk is
appended to the same request (after what it generated so far), which keeps its KV cache
between chunks, and the request ends when the generator ends (engine/core/streaming.py has the
whole protocol). Pause and sleep state live in the engine core: requests that arrive while
paused are held there until resume; the control methods here only ask it.
"""
import asyncio
import collections
import logging
import os
import time
import uuid
from typing import Any, AsyncGenerator, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from engine.config import EngineConfig
from engine.core.streaming import StreamingInput, check_streaming_params
from engine.default_model import resolve_model
from engine.errors import EngineDeadError, InvalidRequestError
from engine.frontend.metrics import StatsLogger, engine_metrics
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.outputs import CompletionOutput, PoolingOutput, RequestOutput
from engine.frontend.processor import Processor, PromptType, load_tokenizer
from engine.frontend.tracing import RequestTracer
from engine.process.core_client import AsyncMPClient
from engine.process.replicas import Route
from engine.process.utility import UpdateTrace, group_replicas
from engine.protocol import EngineConnection, EngineCoreRequest, StreamInput
from engine.routed_experts import routing_shape
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.worker.functions import function_path
from engine.worker.hf_export import DEFAULT_MAX_SHARD_BYTES
from engine.worker.lora import LoRARequest

__all__ = ["AsyncLLM", "StreamingInput"]
OUTPUTS_PER_SLICE = 128  # the output handler yields to the event loop this often


class RequestOutputCollector:
    """The queue between the output handler and one generate() call. If the consumer lags,
    outputs merge instead of piling up: DELTA outputs concatenate, others keep the newest;
    an output that ends a streaming-input chunk is never merged away."""

    def __init__(self, kind: RequestOutputKind):
        self.kind = kind
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()

    def put(self, item: RequestOutput | Exception) -> None:
        last = self.items[-1] if self.items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput) \
                and not any(c.finish_reason for c in last.outputs):
            if self.kind == RequestOutputKind.DELTA:
                merge_delta(last, item)
            else:
                self.items[-1] = item
        else:
            self.items.append(item)
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        item = self.items.popleft()
        if not self.items:
            self.ready.clear()
        if isinstance(item, Exception):
            raise item
        return item


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append a DELTA output's new tokens (and text, logprobs, versions) to an earlier one."""
    for a, b in zip(into.outputs, new.outputs):
        a.text += b.text
        a.token_ids += b.token_ids
        a.weight_versions += b.weight_versions
        a.lora_versions += b.lora_versions
        if a.logprobs is not None and b.logprobs is not None:
            a.logprobs += b.logprobs
        if a.top_logprobs is not None and b.top_logprobs is not None:
            a.top_logprobs += b.top_logprobs
        if a.sampling_masks is not None and b.sampling_masks is not None:  # (a new list: `a`'s may be shared)
            a.sampling_masks = a.sampling_masks + b.sampling_masks
        if b.routed_experts is not None:
            append_routed_experts(a, b.routed_experts)
        a.finish_reason, a.stop_reason = b.finish_reason, b.stop_reason
    into.finished = new.finished


def append_routed_experts(into: CompletionOutput, rows: np.ndarray) -> None:
    """DELTA rows (the next positions) after `into`'s, in amortized O(rows): merged streams (the
    abort manifest's records, a session turn) would copy the whole array per token otherwise. The
    rows live in a buffer of spare capacity that only this function makes and writes, past the
    end of every view of it handed out."""
    have = into.routed_experts
    if have is None:
        into.routed_experts = rows
        return
    n, m = have.shape[0], rows.shape[0]
    buf = getattr(into, "_routed_buffer", None)
    if buf is None or have.base is not buf or buf.shape[0] < n + m:
        buf = np.empty((max(n + m, 2 * n), *have.shape[1:]), dtype=have.dtype)
        buf[:n] = have
        into._routed_buffer = buf
    buf[n:n + m] = rows
    into.routed_experts = buf[:n + m]


class AsyncLLM:
    """The online engine. `model=None` loads the embedded default; other keyword arguments are
    EngineConfig fields. `connection` attaches to engine cores another process started (an API
    server beside others); by default AsyncLLM starts and owns its engine cores."""

    def __init__(self, model: str | None = None, connection: EngineConnection | None = None, **config):
        self.config = EngineConfig(model=resolve_model(model), **config)
        endpoint = self.config.otlp_traces_endpoint  # (before the engine starts: a missing SDK fails here)
        tracer = RequestTracer.otlp(endpoint) if endpoint else None
        self.tokenizer = load_tokenizer(self.config)
        self.client = AsyncMPClient(self.config, connection)
        self.processor = Processor(self.config, self.tokenizer, self.client.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, tracer, routing_shape(self.config))
        self._output_handler: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self._stats_logger = StatsLogger()
        self.dead_error: EngineDeadError | None = None

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    # ---- generation ---------------------------------------------------------------------------
    async def generate(self, prompt: PromptType | AsyncGenerator, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request: LoRARequest | None = None,
                       cache_salt: str | None = None, route: Route | None = None,
                       trace_headers: Mapping[str, str] | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream RequestOutputs for one request (cumulative, delta or final-only, per
        sampling_params.output_kind). Closing the generator or cancelling the task aborts it.
        lora_request: run with this LoRA adapter (loaded on first use; needs enable_lora).
        cache_salt: its prompt reuses (and leaves) cached prefix blocks only among requests with
        the same salt. route: the replica to run on (a data_parallel_rank or a session key).
        trace_headers: W3C traceparent / tracestate: the parent of its span when tracing is on
        (vLLM's argument; without it, the OpenTelemetry context current here)."""
        self._start_output_handler()
        params = sampling_params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.output_processor.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        if hasattr(prompt, "__aiter__"):
            if lora_request is not None:
                raise InvalidRequestError("LoRA adapters with streaming input are not supported", "lora_request")
            async for out in self._generate_streaming(prompt, params, request_id):
                yield out
            return
        text, ids, mm = self.processor.process(prompt, params)
        if lora_request is not None:
            await self.add_lora(lora_request)
        collector = RequestOutputCollector(params.output_kind)
        reqs = self.processor.core_requests(request_id, ids, params, lora_request.lora_int_id if lora_request else 0,
                                            mm, cache_salt)
        self.output_processor.add_request(request_id, text, ids, params, [r.request_id for r in reqs], queue=collector,
                                          trace_headers=trace_headers)
        finished = False
        try:
            await self.client.add_requests_async(reqs, route)
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._abort_now(request_id)

    async def _generate_streaming(self, inputs: AsyncGenerator, params: SamplingParams,
                                  request_id: str) -> AsyncGenerator[RequestOutput, None]:
        check_streaming_params(params)
        try:
            first = await inputs.__anext__()
        except StopAsyncIteration:
            raise InvalidRequestError("the streaming input produced no chunk") from None
        if first.sampling_params is not None:
            check_streaming_params(first.sampling_params)
            params = first.sampling_params
        text, ids, mm = self.processor.process(first.prompt, params)
        if mm:
            raise InvalidRequestError("images with streaming input are not supported", "multi_modal_data")
        collector = RequestOutputCollector(params.output_kind)
        self.output_processor.add_request(request_id, text, ids, params, [request_id], queue=collector)
        finished = False
        feeder = None
        try:
            await self.client.add_requests_async(
                [EngineCoreRequest(request_id, ids, params, self.processor.eos_token_id, streaming=True)])
            feeder = asyncio.ensure_future(self._feed(inputs, request_id, collector))
            while not finished:
                out = await collector.get()
                finished = out.finished
                yield out
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()
            if not finished:
                self._abort_now(request_id)

    async def _feed(self, inputs: AsyncGenerator, request_id: str, collector: RequestOutputCollector) -> None:
        try:
            async for chunk in inputs:
                if chunk.sampling_params is not None:
                    check_streaming_params(chunk.sampling_params)
                _, ids = self.processor.tokenize(chunk.prompt)
                if not ids:
                    raise InvalidRequestError("a streaming-input chunk is empty")
                await self.client.add_stream_input_async(StreamInput(request_id, ids, chunk.sampling_params))
            await self.client.add_stream_input_async(StreamInput(request_id, [], None, final=True))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bad chunk fails this request only
            collector.put(e if isinstance(e, (InvalidRequestError, EngineDeadError)) else InvalidRequestError(str(e)))

    def _abort_now(self, request_id: str) -> None:
        """Forget the request here and tell the core, without awaiting (safe in finally blocks)."""
        children = self.output_processor.abort(request_id)
        if children and self.dead_error is None:
            asyncio.ensure_future(self._abort_quietly(children))

    async def _abort_quietly(self, request_ids: list[str]) -> None:
        """An abort nobody awaits: a core that died meanwhile took the requests with it (its death
        is reported once, by the output handler), so its EngineDeadError is expected here, not a
        "Future exception was never retrieved" in the log."""
        try:
            await self.client.abort_requests_async(request_ids)
        except EngineDeadError:
            pass

    def has_request(self, request_id: str) -> bool:
        """Whether the request is still live here (not finished, aborted or failed)."""
        return request_id in self.output_processor.requests

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """Return once no request of this frontend is in flight (vLLM's name and default);
        TimeoutError after `drain_timeout` seconds. Requests held by a pause count: resume, or
        this times out."""
        deadline = time.monotonic() + drain_timeout
        while self.output_processor.requests:
            if self.dead_error is not None:
                raise self.dead_error
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{len(self.output_processor.requests)} request(s) still in flight after "
                                   f"{drain_timeout} s waiting for requests to drain")
            await asyncio.sleep(0.01)

    async def abort(self, request_id: str | Sequence[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            state = self.output_processor.requests.get(rid)
            children = self.output_processor.abort(rid)
            if state is not None and state.queue is not None:  # the caller gets a final output now
                for seq in state.seqs:
                    if seq.finish_reason is None or seq.resumable:  # not finished for real
                        seq.finish_reason, seq.resumable = "abort", False
                state.queue.put(self.output_processor.make_output(state))  # honours DELTA
            if children:
                await self.client.abort_requests_async(children)

    async def encode(self, prompt: PromptType, pooling: str = "last", request_id: str | None = None,
                     normalize: bool = False) -> AsyncGenerator[PoolingOutput, None]:
        """Yields one PoolingOutput (as vLLM's encode, an async generator): see LLM.encode."""
        params = SamplingParams(pooling=pooling, max_tokens=1, detokenize=False,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async for out in self.generate(prompt, params, request_id):
            yield PoolingOutput.of(out, normalize)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """("generate", "embed") for a causal LM, ("classify",) for a sequence classifier."""
        return self.processor.supported_tasks()

    # ---- the output handler ---------------------------------------------------------------------
    def _start_output_handler(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error
        if self._output_handler is None or self._output_handler.done():
            self._output_handler = asyncio.get_running_loop().create_task(self._handle_outputs())
        if self.config.log_stats_interval_s and (self._stats_task is None or self._stats_task.done()):
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats_forever())

    async def _log_stats_forever(self) -> None:
        while self.dead_error is None:
            await asyncio.sleep(self.config.log_stats_interval_s)
            try:
                await self.do_log_stats()
            except Exception as e:  # noqa: BLE001 - a stats line must never take the engine down
                logging.getLogger("engine").debug("do_log_stats failed: %s", e)

    async def _handle_outputs(self) -> None:
        op = self.output_processor
        try:
            while True:
                msg = await self.client.get_output_async()
                outs = msg.outputs
                for start in range(0, len(outs), OUTPUTS_PER_SLICE):
                    ready, to_abort = op.process_outputs(outs[start:start + OUTPUTS_PER_SLICE], msg.timestamp)
                    for state, out in ready:
                        if isinstance(out, RequestOutput):
                            out.core_timestamp = msg.timestamp
                        if state.queue is not None:
                            state.queue.put(out)
                    if to_abort:
                        await self.client.abort_requests_async(to_abort)
                    if len(outs) > OUTPUTS_PER_SLICE:
                        await asyncio.sleep(0)
        except EngineDeadError as e:
            self.dead_error = e
            for state in list(op.requests.values()):
                if state.queue is not None:
                    state.queue.put(e)
            op.requests.clear()
            op.child_to_parent.clear()

    # ---- RL control: pause / resume (the engine core owns the state) ------------------------------
    async def pause_generation(self, mode: str = "abort", clear_cache: bool = True,
                               timeout_s: float | None = None, recompute_kv: bool = False,
                               unless_paused: bool = False) -> dict:
        """Stop generating. "abort": in-flight requests end now with finish_reason "abort" and the
        tokens so far; "wait": they run to completion (this returns then); "keep": they freeze in
        place (KV kept) and continue after resume_generation(). New requests are held until the
        resume either way; with `timeout_s` the pause lifts itself (logged) if nobody resumed
        within it. `recompute_kv` (keep): frozen requests recompute their KV under weights pushed
        during the pause instead of reusing the old weights' KV (EngineCore.pause_generation).
        `unless_paused`: a pause (or sleep) already in place stays exactly as it is. Returns
        {"aborted": n, "kept": n (frozen by keep), "mode": mode, "was_paused": bool}."""
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}", "mode")
        return await self._call("pause_generation", mode, clear_cache, timeout_s, recompute_kv, unless_paused)

    async def resume_generation(self) -> dict:
        """Resume; returns {"paused_seconds": how long generation was paused, or None}."""
        return await self._call("resume_generation")

    async def is_paused(self) -> bool:
        return await self._call("is_paused")

    # ---- RL control: weights and sleep ------------------------------------------------------------
    async def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                                   backend: str = "gloo", timeout_s: float = 60.0, rank_offset: int = 1,
                                   group_name: str | None = None, replicas: list[int] | None = None) -> list[int]:
        """See LLM.init_weight_transfer."""
        return await self._call("init_weight_transfer", master_address, master_port, world_size, backend, timeout_s,
                                replica_ranks=group_replicas(self.client.replica_ranks(), replicas),
                                rank_offset=rank_offset, group_name=group_name)

    # `lora_id`: update that loaded LoRA adapter instead (see LLM.update_weights).
    async def update_weights(self, version: int | None = None, lora_id: int = 0, shared: dict | None = None) -> dict:
        """Receive one push from the trainer's WeightSender; bumps the version, clears caches
        (`shared`: see LLM.update_weights)."""
        return await self.update_weights_from("broadcast", [] if shared is None else [shared], version, lora_id)

    async def update_weights_from_named(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                        flattened: bool = False, version: int | None = None) -> dict:
        """Receive one push in SGLang's wire (weight_sync/named.py) over the named group: the
        trainer broadcasts these tensors in this order (or one flattened bucket). Atomic like
        every update: checked after every byte arrived, live only if every rank staged it."""
        return await self.update_weights_from("named", [names, dtypes, shapes, flattened], version)

    async def update_weights_from_disk(self, path: str, version: int | None = None, lora_id: int = 0) -> dict:
        return await self.update_weights_from("disk", [path], version, lora_id)

    async def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                          version: int | None = None, lora_id: int = 0) -> dict:
        """Tensors from this process (they travel to the engine core as raw frames)."""
        return await self.update_weights_from("tensors", [list(named_tensors)], version, lora_id)

    async def update_weights_from_ipc(self, handles: dict, version: int | None = None, lora_id: int = 0) -> dict:
        """See LLM.update_weights_from_ipc."""
        return await self.update_weights_from("ipc", [handles], version, lora_id)

    async def reload_weights(self, version: int | None = None) -> dict:
        """Reload the start-up checkpoint (the only way back after sleep level 2, besides a push)."""
        return await self.update_weights_from("reload", [], version)

    async def update_weights_from(self, source: str, args: list, version: int | None = None, lora_id: int = 0,
                                  deadline_s: float | None = None, trace: UpdateTrace | None = None,
                                  pause: dict | None = None) -> dict:
        """One update from any source ("broadcast" [], "disk" [path], "ipc" [handles], ...: the
        methods above name theirs), staged everywhere, then live everywhere or nowhere.
        `deadline_s`: staging gives up after that long (TimeoutError; over the trainer's group it
        breaks the group so that its sender fails at once), and what was staged past it never
        goes live. `trace` (engine.process.utility.UpdateTrace): the phase reached (the one that
        failed, if it raises) and each phase's seconds. `pause` ({"mode", "recompute_kv"}, as
        pause_generation's): the update pauses generation itself unless it is paused; where the
        engine receives beside its steps (EngineConfig.stages_weights_beside_steps) only for the
        swap, so requests go on generating with the old weights while the bytes arrive. The
        result's "paused" is that pause's answer; the caller resumes (trace.paused says whether
        it must, also when the update failed)."""
        self._start_output_handler()  # utility results arrive through it
        return await self.client.update_weights_async(source, args, version, lora_id, deadline_s, trace, pause)

    async def lease_weight_spare(self, holder: str, layouts: list[str] = (), replicas: list[int] | None = None) -> dict:
        """See LLM.lease_weight_spare."""
        return await self._call("lease_weight_spare", holder, list(layouts), replicas)

    async def close_weight_transfer(self) -> bool:
        return await self._call("close_weight_transfer")

    async def discard_weights(self, update_id: str | None = None) -> bool:
        """See LLM.discard_weights."""
        return await self._call("discard_weights", update_id)

    async def weights_checksum(self) -> str:
        return await self._call("weights_checksum")

    async def save_sharded_state(self, path: str | os.PathLike, pattern: str | None = None,
                                 max_size: int | None = None) -> dict:
        """Each tensor-parallel rank writes its own slices (see LLM.save_sharded_state)."""
        return await self._call("save_sharded_state", os.fspath(path), pattern, max_size)

    async def save_weights(self, folder: str | os.PathLike, overwrite: bool = False,
                           max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
        """Write the live weights as a Hugging Face folder (see LLM.save_weights)."""
        return await self._call("save_weights", os.fspath(folder), overwrite, max_shard_bytes)

    async def get_weight_version(self, lora_id: int = 0) -> int:
        """The live weights' version (or that of the loaded LoRA adapter `lora_id`)."""
        return await self._call("get_weight_version", lora_id)

    async def set_weight_version(self, version: int, above: int | None = None) -> int:
        """Relabel the live weights; see EngineCore.set_weight_version."""
        return await self._call("set_weight_version", version, above)

    async def sleep(self, level: int = 1, mode: str = "abort") -> bool:
        """Pause (with `mode`, unless paused) and free the KV cache and weights (see LLM.sleep)."""
        return await self._call("sleep", level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> dict:
        """Restore "weights" and/or "kv_cache" (both by default); see EngineCore.wake_up."""
        return await self._call("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self._call("is_sleeping")

    # ---- data parallelism -------------------------------------------------------------------------
    async def scale(self, data_parallel_size: int, drain_timeout_s: float = 60.0) -> dict:
        """Grow or shrink to `data_parallel_size` replicas (see AsyncMPClient.scale_async): new ones
        copy the live weights before taking requests; removed ones drain, then abort what is left
        (with final outputs). A trainer's weight-transfer group covers the old replicas only:
        call init_weight_transfer again after a scale. Returns {"data_parallel_size", "added",
        "removed"}."""
        self._start_output_handler()
        return await self.client.scale_async(data_parallel_size, drain_timeout_s)

    def cancel_scale(self) -> None:
        """Make a running scale-up fail now (a server shutting down): its new replicas are stopped."""
        self.client.cancel_scale()

    # ---- control --------------------------------------------------------------------------------
    async def _call(self, method: str, *args, timeout: float | None = None, **kwargs) -> Any:
        self._start_output_handler()  # utility results arrive through it
        return await self.client.call_utility_async(method, *args, timeout=timeout, **kwargs)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def reset_encoder_cache(self) -> bool:
        """Forget the vision encoder's cached outputs (a vision-language model)."""
        return await self._call("reset_encoder_cache")

    async def reset_mm_cache(self) -> bool:
        """vLLM's name: the multimodal cache, here the encoder cache."""
        return await self._call("reset_mm_cache")

    async def get_stats(self) -> dict:
        return await self._call("get_stats")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a PEFT LoRA adapter (engine/worker/lora.py; needs enable_lora); False if the id is
        registered already. generate(..., lora_request=) registers it on first use."""
        r = lora_request
        return await self._call("add_lora", r.lora_name, r.lora_int_id, r.lora_path)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self._call("remove_lora", lora_id)

    async def pin_lora(self, lora_id: int) -> bool:
        """Never evict this adapter (max_loras counts it)."""
        return await self._call("pin_lora", lora_id)

    async def list_loras(self) -> list[int]:
        return await self._call("list_loras")

    async def get_metrics(self) -> list:
        """The engine's series as Python objects (engine.frontend.metrics: Counter, Gauge, Histogram): the
        engine core's counters and state, and the requests this frontend saw finish."""
        return engine_metrics(await self.get_stats()) + self.output_processor.stats.metrics()

    async def do_log_stats(self) -> str:
        """Log (logger "engine", INFO) and return one line: token rates since the last call,
        running / waiting requests, KV usage, prefix hit rate, weight version."""
        line = self._stats_logger.line(await self.get_stats())
        logging.getLogger("engine").info(line)
        return line

    async def start_profile(self) -> bool:
        """Start a torch-profiler trace of the engine core (needs profiler_dir; engine/worker/profiler.py)."""
        return await self._call("start_profile")

    async def stop_profile(self) -> list[str]:
        """Stop it and write the trace: the paths written, one per engine-core replica."""
        return await self._call("stop_profile")

    async def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list[Any]:
        """Call a public worker method (or worker-extension method) on every worker."""
        return await self._call("collective_rpc", method, list(args), kwargs or {}, timeout=timeout)

    async def apply_model(self, fn: Callable | str) -> list[Any]:
        """fn(model) on every worker, one result per worker (see LLM.apply_model)."""
        return await self._call("apply_model", function_path(fn))

    async def check_health(self) -> dict:
        """{"replicas": [replica indices], "alive": [the live ones]}; EngineDeadError when none lives."""
        if self.dead_error is not None:
            raise self.dead_error
        self._start_output_handler()  # (heartbeats arrive through it)
        return self.client.check_health()

    @property
    def errored(self) -> bool:
        return self.dead_error is not None or self.client.dead_reason is not None

    async def is_tracing_enabled(self) -> bool:
        """Whether each finished request exports a span (otlp_traces_endpoint; vLLM's method)."""
        return self.output_processor.tracer is not None

    def shutdown(self) -> None:
        for task in (self._output_handler, self._stats_task):
            if task is not None:
                task.cancel()
        self.client.shutdown()
        if self.output_processor.tracer is not None:  # the spans still batched go out now
            self.output_processor.tracer.shutdown()
