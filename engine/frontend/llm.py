"""LLM: the offline engine. Generate for a batch of prompts, synchronously.

    llm = LLM()                                   # the embedded default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    outs = llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=32))

By default the engine core runs in a child process (as behind AsyncLLM); `multiprocess=False`
keeps it in this process, for tests and debugging.
"""
import itertools
import logging
import os
import time
import weakref
from typing import Any, Callable, Iterable, Sequence

import torch
from tqdm import tqdm
from typing_extensions import Self

from engine.config import EngineConfig
from engine.default_model import resolve_model
from engine.errors import InvalidRequestError
from engine.frontend.metrics import StatsLogger, engine_metrics
from engine.frontend.output_processor import OutputProcessor
from engine.frontend.outputs import PoolingOutput, RequestOutput
from engine.frontend.processor import Processor, PromptType, load_tokenizer
from engine.frontend.tracing import RequestTracer
from engine.process.core_client import InprocClient, SyncMPClient
from engine.process.utility import UpdateTrace, group_replicas
from engine.routed_experts import routing_shape
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.worker.functions import function_path
from engine.worker.hf_export import DEFAULT_MAX_SHARD_BYTES
from engine.worker.lora import LoRARequest

ParamsArg = SamplingParams | Sequence[SamplingParams] | None


class LLM:
    """Offline engine. `model=None` loads the embedded default (SmolLM2-135M-Instruct); other
    keyword arguments are EngineConfig fields (dtype, max_num_seqs, max_model_len, ...)."""

    def __init__(self, model: str | None = None, multiprocess: bool = True, **config):
        self.config = EngineConfig(model=resolve_model(model), **config)
        endpoint = self.config.otlp_traces_endpoint  # (before the engine starts: a missing SDK fails here)
        tracer = RequestTracer.otlp(endpoint) if endpoint else None
        self.tokenizer = load_tokenizer(self.config)
        self.client = SyncMPClient(self.config) if multiprocess else InprocClient(self.config)
        # An LLM dropped without shutdown() stops its engine cores when collected: the client's
        # output thread keeps the client alive, so nothing else would.
        self._finalizer = weakref.finalize(self, self.client.shutdown)
        self.processor = Processor(self.config, self.tokenizer, self.client.max_model_len)
        self.output_processor = OutputProcessor(self.tokenizer, tracer, routing_shape(self.config))
        self._ids = itertools.count()
        self._stats_logger = StatsLogger()
        self._next_log = time.monotonic() + (self.config.log_stats_interval_s or 0)

    def generate(self, prompts: PromptType | Sequence[PromptType], sampling_params: ParamsArg = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Prompts: strings, token-id lists, or dicts
        with 'prompt' / 'prompt_token_ids'. Raises InvalidRequestError (a ValueError) before
        running anything if any prompt or parameter is bad."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict (or a list of prompts); "
                                      f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidRequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        processed = [self.processor.process(p, sp) for p, sp in zip(prompts, params)]
        wanted = max((sp.min_weight_version for sp in params if sp.min_weight_version is not None), default=None)
        if wanted is not None and wanted > (live := self.get_weight_version()):  # nothing pushes while this blocks
            raise InvalidRequestError(f"min_weight_version {wanted} is above the live weight version {live}: "
                                      "generate() would wait for a push that cannot come while it runs",
                                      "min_weight_version")
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidRequestError(f"{len(prompts)} prompts but {len(loras)} LoRA requests", "lora_request")
        for lora in {lr for lr in loras if lr is not None}:
            self.add_lora(lora)
        request_ids, groups = [], []
        try:
            for (text, token_ids, mm), sp, lora in zip(processed, params, loras):
                rid = str(next(self._ids))
                reqs = self.processor.core_requests(rid, token_ids, sp, lora.lora_int_id if lora else 0, mm)
                final_only = sp.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.output_processor.add_request(rid, text, token_ids, final_only, [r.request_id for r in reqs])
                request_ids.append(rid)
                groups.append(reqs)
            self.client.add_requests(groups)  # one message per replica: each admits its share whole
            task = "encode" if all(sp.pooling for sp in params) else "generate"  # (the progress bar's label)
            return self._run(request_ids, use_tqdm and len(request_ids) > 1, task)
        except BaseException:
            self._abort(request_ids)
            raise

    def encode(self, prompts: PromptType | Sequence[PromptType], pooling: str = "last", normalize: bool = False,
               use_tqdm: bool = True) -> list[PoolingOutput]:
        """One PoolingOutput per prompt: the final hidden state at the last prompt token
        (pooling="last") or averaged over the prompt ("mean"), L2-normalized if asked; on a
        sequence classifier (a reward model), its head's label logits of that vector."""
        params = SamplingParams(pooling=pooling, max_tokens=1, detokenize=False)
        return [PoolingOutput.of(o, normalize) for o in self.generate(prompts, params, use_tqdm)]

    def get_supported_tasks(self) -> tuple[str, ...]:
        """("generate", "embed") for a causal LM, ("classify",) for a sequence classifier."""
        return self.processor.supported_tasks()

    def chat(self, conversations, sampling_params: ParamsArg = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate replies for one conversation (a list of message dicts) or a list of them,
        templated by the tokenizer's chat template."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.processor.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, request_ids: list[str], show_progress: bool, task: str) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc=task, unit="req", dynamic_ncols=True) if show_progress else None
        try:
            while len(done) < len(request_ids):
                if self.config.log_stats_interval_s and time.monotonic() >= self._next_log:
                    self._next_log = time.monotonic() + self.config.log_stats_interval_s
                    self.do_log_stats()
                msg = self.client.get_output()
                ready, to_abort = self.output_processor.process_outputs(msg.outputs, msg.timestamp)
                if to_abort:
                    self.client.abort_requests(to_abort)
                for _, out in ready:
                    if isinstance(out, Exception):
                        raise out
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[rid] for rid in request_ids]

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            children = self.output_processor.abort(rid)
            if children:
                self.client.abort_requests(children)

    # ---- control and introspection ----------------------------------------------------------
    def reset_prefix_cache(self) -> bool:
        return self.client.call_utility("reset_prefix_cache")

    def reset_encoder_cache(self) -> bool:
        """Forget the vision encoder's cached outputs (a vision-language model)."""
        return self.client.call_utility("reset_encoder_cache")

    def reset_mm_cache(self) -> bool:
        """vLLM's name: the multimodal cache, here the encoder cache."""
        return self.client.call_utility("reset_mm_cache")

    def get_stats(self) -> dict:
        return self.client.call_utility("get_stats")

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register a PEFT LoRA adapter (engine/worker/lora.py; needs enable_lora); False if the id is
        registered already. generate(..., lora_request=) registers it on first use."""
        r = lora_request
        return self.client.call_utility("add_lora", r.lora_name, r.lora_int_id, r.lora_path)

    def remove_lora(self, lora_id: int) -> bool:
        return self.client.call_utility("remove_lora", lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        """Never evict this adapter (max_loras counts it)."""
        return self.client.call_utility("pin_lora", lora_id)

    def list_loras(self) -> list[int]:
        return self.client.call_utility("list_loras")

    def get_metrics(self) -> list:
        """The engine's series as Python objects (engine.frontend.metrics: Counter, Gauge, Histogram): the
        engine core's counters and state, and the requests this LLM saw finish."""
        return engine_metrics(self.get_stats()) + self.output_processor.stats.metrics()

    def do_log_stats(self) -> str:
        """Log (logger "engine", INFO) and return one line: token rates since the last call,
        running / waiting requests, KV usage, prefix hit rate, weight version."""
        line = self._stats_logger.line(self.get_stats())
        logging.getLogger("engine").info(line)
        return line

    def start_profile(self) -> bool:
        """Start a torch-profiler trace of the engine core (needs profiler_dir; engine/worker/profiler.py)."""
        return self.client.call_utility("start_profile")

    def stop_profile(self) -> list[str]:
        """Stop it and write the trace: the paths written, one per engine-core replica."""
        return self.client.call_utility("stop_profile")

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list[Any]:
        """Call a worker method (or a worker-extension method) on every worker."""
        return self.client.call_utility("collective_rpc", method, list(args), kwargs or {}, timeout=timeout)

    def apply_model(self, fn: Callable | str) -> list[Any]:
        """fn(model) on every worker (vLLM's LLM.apply_model): one result per worker, in rank order
        (every replica's with data parallelism). `fn`: a module-level function or its import path
        ("package.module:function"); the workers import it, code is never pickled (a lambda or a
        closure is refused). It gets the engine.model.decoder.LlamaModel; its result must travel
        as msgpack (plain values, tensors)."""
        return self.client.call_utility("apply_model", function_path(fn))

    def check_health(self) -> dict:
        """{"replicas": [replica indices], "alive": [the live ones]}; EngineDeadError when none lives."""
        return self.client.check_health()

    # ---- RL control (synchronous twins of AsyncLLM's; the engine core owns the state) ------------
    # Offline, generate() returns only when its requests are done, so pausing matters between
    # calls: "keep" freezes requests left in the engine; weights updates need a paused or idle engine.
    def pause_generation(self, mode: str = "abort", clear_cache: bool = True,
                         timeout_s: float | None = None, recompute_kv: bool = False,
                         unless_paused: bool = False) -> dict:
        """See AsyncLLM.pause_generation."""
        if mode not in ("abort", "wait", "keep"):
            raise InvalidRequestError(f"pause mode must be 'abort', 'wait' or 'keep', got {mode!r}", "mode")
        return self.client.call_utility("pause_generation", mode, clear_cache, timeout_s, recompute_kv,
                                        unless_paused)

    def resume_generation(self) -> dict:
        return self.client.call_utility("resume_generation")

    def is_paused(self) -> bool:
        return self.client.call_utility("is_paused")

    def init_weight_transfer(self, master_address: str, master_port: int, world_size: int,
                             backend: str = "gloo", timeout_s: float = 60.0, rank_offset: int = 1,
                             group_name: str | None = None, replicas: list[int] | None = None) -> list[int]:
        """Every worker joins the trainer's group (the trainer is rank 0; the workers take
        `rank_offset`, `rank_offset` + 1, ...); returns their ranks. `group_name`: form it as a
        named torch.distributed group, as SGLang's trainers (slime, AReaL) do, for
        update_weights_from_named. `replicas`: only those data-parallel replicas' workers join
        (the others leave any group they were in: a trainer on their machine writes their part
        through shared memory, update_weights' `shared`)."""
        return self.client.call_utility("init_weight_transfer", master_address, master_port, world_size,
                                        backend, timeout_s,
                                        replica_ranks=group_replicas(self.client.replica_ranks(), replicas),
                                        rank_offset=rank_offset, group_name=group_name)

    # Every update_weights* takes `lora_id`: then it updates that loaded LoRA adapter instead
    # (tensors by PEFT names, a subset is fine; "disk": a PEFT folder), atomically, under the
    # adapter's own version (its tokens carry it in CompletionOutput.lora_versions). A pushed
    # adapter is pinned: its weights exist nowhere else.
    def update_weights(self, version: int | None = None, lora_id: int = 0, shared: dict | None = None) -> dict:
        """Receive one push from the trainer's WeightSender; bumps the version, clears caches.
        `shared`: {"replicas": [handles, each with its "replica"]}: the replicas it names read
        the push from shared memory instead (their leased spares written, or a segment), the
        others receive it over the group (which the named ones are not in: init_weight_transfer's
        `replicas`); one update, atomic across all of them."""
        return self.client.update_weights("broadcast", [] if shared is None else [shared], version, lora_id)

    def update_weights_from_named(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                  flattened: bool = False, version: int | None = None) -> dict:
        """Receive one push in SGLang's wire (weight_sync/named.py) over the named group: the
        trainer broadcasts these tensors in this order (or one flattened bucket)."""
        return self.client.update_weights("named", [names, dtypes, shapes, flattened], version)

    def update_weights_from_disk(self, path: str, version: int | None = None, lora_id: int = 0) -> dict:
        return self.client.update_weights("disk", [path], version, lora_id)

    def update_weights_from_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                                    version: int | None = None, lora_id: int = 0) -> dict:
        """Tensors from this process (to an engine-core process they travel as raw frames)."""
        return self.client.update_weights("tensors", [list(named_tensors)], version, lora_id)

    def update_weights_from_ipc(self, handles: dict, version: int | None = None, lora_id: int = 0) -> dict:
        """Tensors shared by another process on this machine: `weight_sync.SharedWeights().share(...)`
        (CUDA IPC for a trainer on the same GPU, shared memory on CPU); the trainer keeps them
        alive until this returns."""
        return self.client.update_weights("ipc", [handles], version, lora_id)

    def reload_weights(self, version: int | None = None) -> dict:
        """Reload the start-up checkpoint (the only way back after sleep level 2, besides a push)."""
        return self.client.update_weights("reload", [], version)

    def update_weights_from(self, source: str, args: list, version: int | None = None, lora_id: int = 0,
                            deadline_s: float | None = None, trace: UpdateTrace | None = None,
                            pause: dict | None = None) -> dict:
        """One update from any source, with a deadline, a trace of its phases and a pause of its
        own (see AsyncLLM.update_weights_from)."""
        return self.client.update_weights(source, args, version, lora_id, deadline_s, trace, pause)

    def lease_weight_spare(self, holder: str, layouts: list[str] = (), replicas: list[int] | None = None) -> dict:
        """For a trainer on this machine: where to write its next update itself (the engine's
        staging memory in shared memory; engine/worker/weight_buffers.py). Write the tensors the
        layout names, then update_weights_from_ipc({"kind": "spare", "lease", "tensors": names}):
        weight_sync.SpareWriter writes them and makes those handles. `layouts`: the packs the
        trainer can run (its SpareWriter's `layouts`): the projections' panels are then leased.
        A replica of several tensor-parallel ranks lends one per rank ({"ranks": [leases]}, for its
        slices). With data parallelism every replica lends its own ({"replicas": [leases]}), or
        only `replicas`."""
        return self.client.call_utility("lease_weight_spare", holder, list(layouts), replicas)

    def close_weight_transfer(self) -> bool:
        return self.client.call_utility("close_weight_transfer")

    def discard_weights(self, update_id: str | None = None) -> bool:
        """Drop a staged update that never went live (every replica); with `update_id` (an
        UpdateTrace's) only that one: False where another update replaced it since."""
        return self.client.call_utility("discard_weights", update_id)

    def weights_checksum(self) -> str:
        return self.client.call_utility("weights_checksum")

    def save_sharded_state(self, path: str | os.PathLike, pattern: str | None = None,
                           max_size: int | None = None) -> dict:
        """Each tensor-parallel rank writes its own slices (engine/worker/sharded_state.py): an
        engine with the same tensor_parallel_size starts from the folder reading only its shards.
        Returns {"path", "files" (per rank), "bytes"}."""
        return self.client.call_utility("save_sharded_state", os.fspath(path), pattern, max_size)

    def save_weights(self, folder: str | os.PathLike, overwrite: bool = False,
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict:
        """Write the live weights (pushes included) as a Hugging Face folder that transformers
        loads: safetensors in the served dtype (shards of at most max_shard_bytes and their index
        when larger), config.json, generation_config.json, the tokenizer's files. A target that
        exists and is not empty is refused unless `overwrite`; a failure leaves no half folder.
        With data parallelism the first replica writes. Returns {"path", "files", "bytes",
        "tensors", "weight_version"}."""
        return self.client.call_utility("save_weights", os.fspath(folder), overwrite, max_shard_bytes)

    def get_weight_version(self, lora_id: int = 0) -> int:
        """The live weights' version (or that of the loaded LoRA adapter `lora_id`)."""
        return self.client.call_utility("get_weight_version", lora_id)

    def set_weight_version(self, version: int, above: int | None = None) -> int:
        """Relabel the live weights; see EngineCore.set_weight_version."""
        return self.client.call_utility("set_weight_version", version, above)

    def sleep(self, level: int = 1, mode: str = "abort") -> bool:
        """Pause (with `mode`, unless paused), free the KV cache, and offload (level 1) or drop
        (level 2: a push or reload_weights() must follow) the weights."""
        return self.client.call_utility("sleep", level, mode)

    def wake_up(self, tags: list[str] | None = None) -> dict:
        return self.client.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.client.call_utility("is_sleeping")

    def is_tracing_enabled(self) -> bool:
        """Whether each finished request exports a span (otlp_traces_endpoint; vLLM's method)."""
        return self.output_processor.tracer is not None

    def shutdown(self) -> None:
        self._finalizer()  # client.shutdown(), once
        if self.output_processor.tracer is not None:  # the spans still batched go out now
            self.output_processor.tracer.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
