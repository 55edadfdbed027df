"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

    execute_model(so): update_states -> prepare_inputs -> model.forward -> compute_logits
                       -> prompt_logprobs (chunks that ask) -> sample (rows that reach their end)

It owns the model weights, the KV cache tensors and each request's sampling state (params,
seeded generator, prompt-logprob progress); everything else it reads from the SchedulerOutput.
It never imports the scheduler or the KV block manager.

With tensor parallelism every rank runs this same step on the same SchedulerOutput (its shard of
the model, its kv heads of the cache); only rank 0 gets the gathered logits, so only rank 0
samples and computes logprobs, and its output is the step's.

Routed experts (enable_return_routed_experts, engine/routed_experts.py): `routing` lives beside the
KV cache, one row per KV slot, and the model writes each computed token's experts into it; a
request that asks gets, at each of its sampling steps, the rows of the positions that became
available since its previous one (on its first: from position 0, prefix-cache hits included).
"""
import bisect
import functools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.errors import EngineStateError
from engine.model.attention import AttentionMetadata, device_tensor, per_token_decode_rows, step_metadata
from engine.model.decoder import LlamaModel
from engine.model.parallel import TPGroup
from engine.protocol import MMFeature, SamplingMask
from engine.routed_experts import DTYPE as ROUTING_DTYPE
from engine.sampling_params import MAX_SAMPLING_MASK_IDS, SamplingParams
from engine.step_io import PLACEHOLDER_TOKEN, ModelRunnerOutput, NewRequestData, ScheduledRequest, SchedulerOutput
from engine.worker.cuda_graphs import DecodeGraphs
from engine.worker.expert_parallel import expert_parallel_group
from engine.worker.lora import Adapter, LoRABatch, LoRARequest, load_adapter
from engine.worker.profiler import phase
from engine.worker.sharded_state import is_sharded_state, read_rank
from kernels.kv_quant import row_size
from kernels.sampling import SamplingMetadata, log_softmax, sample

GiB = 1 << 30
CPU_DEFAULT_KV_CACHE_MEMORY = 2 * GiB


@dataclass
class CachedRequestState:
    """What the runner keeps for a request between steps."""

    params: SamplingParams
    generator: torch.Generator | None  # seeded requests draw from their own generator
    prompt_token_ids: list[int] | None = None  # only with prompt_logprobs (the targets)
    num_prompt_logprobs: int = 0  # prompt positions done (a recompute after preemption skips them)
    pool_sum: torch.Tensor | None = None  # mean pooling: float32 sum of the hidden states so far
    lora_id: int = 0  # its LoRA adapter (0: the base model)
    mm_features: list[MMFeature] | None = None  # its prompt's images
    routed_sent: int = 0  # return_routed_experts: positions [0, routed_sent) were sent
    routed_low: int | None = None  # the lowest start since the last sampling step (a recompute goes back)


@dataclass
class StepInputs:
    """One step's flattened batch: decodes first (one token each), then prefill chunks."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    attn: AttentionMetadata
    logit_rows: list[int]  # rows of the T whose logits are needed, in this order
    samplers: list[ScheduledRequest] = field(default_factory=list)  # rows that sample, in logit order
    sample_rows: list[int] = field(default_factory=list)  # their index into logit_rows
    prompt_rows: list[tuple[str, int, range]] = field(default_factory=list)  # (id, first logit row, positions)
    pool_rows: list[tuple[ScheduledRequest, int]] = field(default_factory=list)  # encode requests: (chunk, first row)
    lora: LoRABatch | None = None  # the adapters of the step's tokens (None: all on the base model)
    mm: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, image embeddings) replacing token embeddings


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None):
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        if self.device.type == "cpu":
            from kernels import cpu_ext

            cpu_ext.load()  # build the C++ kernels now (once per machine), not in the first request
        self.ep = expert_parallel_group(config)  # the replicas' group when experts are split between them
        self.model: LlamaModel | None = self.new_model()
        if is_sharded_state(config.model):
            self.model.load_local(read_rank(config.model, self.model.part.rank, config.tensor_parallel_size),
                                  config.model)
        else:
            self.model.load_weights(config.model)
        self.partition = self.model.part  # this rank's share of the model (and of LoRA adapters, KV heads)
        self.num_kv_heads = self.model.num_kv_heads
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)  # unseeded requests
        self.requests: dict[str, CachedRequestState] = {}
        self.kv_cache: torch.Tensor | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # (num slots, num_layers, top_k) int16 with enable_return_routed_experts: each slot's token's
        # experts per layer, -1 in dense layers; allocated and freed with the KV cache
        self.routing: torch.Tensor | None = None
        self.num_blocks = 0
        self.loras: dict[int, Adapter] = {}  # resident LoRA adapters by id, least recently used first (a cache:
        # which adapters exist, their versions and pins are the engine core's LoRARegistry)
        self._lora_stacks: tuple[tuple, dict] = ((), {})  # the last step's adapters' stacked weights
        # vision encoder outputs by image hash, least recently used first, at most
        # encoder_cache_size embedding rows (an image whose prompt is prefilled in chunks is encoded once)
        self.encoder_cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoder_cache_rows = 0
        self.encoder_cache_hits = self.encoder_cache_queries = 0
        self.cuda_graphs = self._decode_graphs()
        # the last step's sampled ids (on the device) and each request's row in them: an async step's
        # placeholder tokens are gathered from these on the device, so the step can be launched
        # before the last one's tokens reach the host (see launch)
        self.last_ids: torch.Tensor | None = None
        self.last_rows: dict[str, int] = {}

    def _decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for all-decode steps (engine/worker/cuda_graphs.py), where the step's forward
        is launch-bound and captures cleanly: one dense model on one GPU. Tensor-parallel ranks
        all-reduce by NCCL between kernels, and the experts' kernels size their grids on the host."""
        c, m = self.config, self.model
        if (self.device.type != "cuda" or c.enforce_eager or m.tp is not None or m.ep is not None
                or c.model_config.moe is not None or c.batch_invariant):
            return None
        return DecodeGraphs(c.max_num_seqs, -(-c.max_model_len // self.block_size), self.device)

    def drop_step_captures(self) -> None:
        """Forget what holds the weights and the KV cache from one step to the next (the CUDA graphs,
        the CPU decode plan): those tensors are about to move or go."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.clear()
        if self.model is not None:
            self.model.drop_decode_plan()

    def new_model(self) -> LlamaModel:
        """The model's tensors, zero (load_weights or a weight push fills them)."""
        c = self.config
        model = LlamaModel(c.model_config, self.dtype, self.device, c.max_model_len, c.batch_invariant, self.tp, self.ep)
        model.use_decode_plan = not c.enforce_eager
        return model

    # ---- KV cache -----------------------------------------------------------------------
    def kv_cache_blocks(self) -> int:
        """How many blocks this rank's memory holds. kv_cache_memory and the CPU default are the
        replica's (all ranks' heads), as without tensor parallelism; on CUDA each rank's device
        holds its own heads (the executor takes the least of the ranks)."""
        c, bs = self.config, self.block_size
        if c.kv_cache_memory is not None or self.device.type == "cpu":
            per_block = c.kv_bytes_per_token() * bs
            budget = int(c.kv_cache_memory) if c.kv_cache_memory is not None else CPU_DEFAULT_KV_CACHE_MEMORY
        else:
            mc = c.model_config
            per_block = mc.num_layers * 2 * self.num_kv_heads * mc.head_dim * self.dtype.itemsize * bs
            free, total = torch.cuda.mem_get_info(self.device)
            activations = 2 * c.max_num_batched_tokens * mc.vocab_size * 4  # logits dominate
            budget = max(int(total * c.gpu_memory_utilization) - (total - free) - activations, 0)
        if budget < per_block:
            raise ValueError(f"kv_cache_memory too small: one block needs {per_block} bytes")
        return budget // per_block

    def init_kv_cache(self, num_blocks: int | None = None) -> int:
        """Allocate the cache (`num_blocks`, or as many as kv_cache_blocks() the first time);
        returns the number of blocks. Pages are touched only as used (CPU)."""
        mc, bs = self.config.model_config, self.block_size
        self.drop_step_captures()
        if num_blocks is not None:
            self.num_blocks = num_blocks
        if not self.num_blocks:
            self.num_blocks = self.kv_cache_blocks()
        codes = self.config.kv_codes  # int8 rows of codes and a scale (kernels/kv_quant.py)
        self.kv_cache = torch.empty(mc.num_layers, 2, self.num_blocks, bs, self.num_kv_heads,
                                    row_size(mc.head_dim, codes), dtype=torch.int8 if codes else self.dtype,
                                    device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        if self.config.enable_return_routed_experts:  # (about 1% of the KV cache's size, not in its budget)
            self.routing = torch.full((self.num_blocks * bs, mc.num_layers, mc.moe.top_k), -1, dtype=torch.int16,
                                      device=self.device)
        return self.num_blocks

    def free_kv_cache(self) -> None:
        self.drop_step_captures()  # (sleep frees the cache first, then moves or drops the weights)
        self.kv_cache, self.kv_caches, self.routing = None, [], None
        # (no placeholder outlives a sleep: the core drains the step in flight first; the ids would
        # keep a block of device memory)
        self.last_ids, self.last_rows = None, {}
        if self.model is not None:
            self.model.routing = None

    # ---- one step -----------------------------------------------------------------------
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(so)()

    def launch(self, so: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start a step. When this returns the step's work is queued on the device but for reading
        the samples back, which the returned function does (it waits for the device; any thread may
        call it, once). With async scheduling the step thread launches the next step meanwhile, its
        placeholder tokens gathered from this step's samples on the device, so a GPU runs the two
        steps back to back instead of idling while the host turns tokens into inputs."""
        read_back: list[Callable[[], None]] = []
        out = self._execute_model(so, read_back)

        def finish() -> ModelRunnerOutput:
            for fn in read_back:
                fn()
            return out
        return finish

    @torch.inference_mode()
    def _execute_model(self, so: SchedulerOutput, read_back: list[Callable[[], None]]) -> ModelRunnerOutput:
        self.update_states(so)
        out = ModelRunnerOutput()
        if not so.scheduled:
            self.idle_step()
            return out
        assert self.kv_cache is not None, "executing while asleep"  # (the core also refuses while it has no weights)
        self.model.routing = self.routing  # (a wake-up at level 2 builds a new model)
        with phase("prepare_inputs"):
            inputs = self.prepare_inputs(so)
        with phase("forward"):
            hidden = self._forward(inputs)
        if self.routing is not None:
            self.routed_experts(so, out)
        if inputs.pool_rows:
            with phase("pool"):
                self.pool(hidden, inputs.pool_rows, out)
        if not inputs.logit_rows:
            return out
        with phase("compute_logits"):
            if len(inputs.logit_rows) < hidden.shape[0]:
                hidden = hidden[device_tensor(inputs.logit_rows, torch.int64, self.device)]
            logits = self.model.compute_logits(hidden)  # (len(logit_rows), V) in the model's dtype
        if logits is None:  # a tensor-parallel rank other than 0: rank 0 samples
            if inputs.samplers:
                self.share_samples(inputs.samplers, sampled=False)
            return out
        with phase("sample"):
            if inputs.prompt_rows:
                self.compute_prompt_logprobs(logits, inputs.prompt_rows, out)
            if inputs.samplers:
                if len(inputs.sample_rows) < logits.shape[0]:
                    logits = logits[device_tensor(inputs.sample_rows, torch.int64, self.device)]
                self.sample(logits, inputs.samplers, out, read_back)
                self.share_samples(inputs.samplers, sampled=True)
        return out

    def share_samples(self, samplers: list[ScheduledRequest], sampled: bool) -> None:
        """Async scheduling with tensor parallelism: the next step's placeholders stand for this
        step's tokens on every rank, and only rank 0 (`sampled`) drew them. One all-reduce of the
        ids (zeros on the other ranks) as float32, exact below 2^24 (EngineConfig checks the
        vocabulary), on the device."""
        if not self.config.async_scheduling or self.tp is None or self.tp.size == 1:
            return
        ids = self.last_ids.float() if sampled else torch.zeros(len(samplers), dtype=torch.float32, device=self.device)
        self.last_ids = self.tp.all_reduce_(ids).long()
        self.last_rows = {sr.request_id: i for i, sr in enumerate(samplers)}

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        graphs, md, n = self.cuda_graphs, inputs.attn, inputs.input_ids.shape[0]
        if (graphs is not None and md.num_decodes == n and inputs.lora is None and inputs.mm is None
                and self.routing is None and graphs.size_for(n) is not None):
            return graphs.run(self.model, inputs.input_ids, inputs.positions, md, self.kv_caches)
        return self.model.forward(inputs.input_ids, inputs.positions, md, self.kv_caches, inputs.lora, inputs.mm)

    @torch.inference_mode()
    def idle_step(self) -> None:
        """Expert parallelism: a step in which this replica has no tokens still serves the other
        replicas' tokens in its experts (engine/process/waves.py calls it; nothing otherwise)."""
        if self.model is not None and self.model.ep is not None:
            self.model.idle_step()

    def update_states(self, so: SchedulerOutput) -> None:
        """Forget finished requests, then (re)load announced ones (in this order: an id can be reused)."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for nr in so.new_requests:
            self.requests[nr.request_id] = self._request_state(nr, self.requests.get(nr.request_id))

    @staticmethod
    def _request_state(nr: NewRequestData, old: CachedRequestState | None) -> CachedRequestState:
        p = nr.sampling_params
        generator = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        if old is not None:  # new params for the next streaming chunk: the prompt's progress stays
            return CachedRequestState(p, generator, old.prompt_token_ids, old.num_prompt_logprobs, lora_id=nr.lora_id,
                                      mm_features=old.mm_features, routed_sent=old.routed_sent,
                                      routed_low=old.routed_low)
        return CachedRequestState(p, generator, nr.prompt_token_ids, lora_id=nr.lora_id, mm_features=nr.mm_features)

    def prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        bs, dev = self.block_size, self.device
        decodes = [r for r in so.scheduled if len(r.token_ids) == 1]
        prefills = [r for r in so.scheduled if len(r.token_ids) > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        inputs = StepInputs(None, None, AttentionMetadata(slot_mapping=None, num_decodes=len(decodes)), logit_rows)

        def want_logits(sr: ScheduledRequest, row: int, n: int) -> None:
            """Rows [row, row + n) hold sr's tokens: ask for prompt logprobs and the sample (an
            encode request: its rows' hidden states)."""
            if self.requests[sr.request_id].params.pooling is not None:
                inputs.pool_rows.append((sr, row))
                return
            pos = self._prompt_logprob_positions(sr)
            if pos:
                inputs.prompt_rows.append((sr.request_id, len(logit_rows), pos))
                logit_rows.extend(range(row + pos.start - sr.start, row + pos.stop - sr.start))
            if sr.sample:
                inputs.sample_rows.append(len(logit_rows))
                inputs.samplers.append(sr)
                logit_rows.append(row + n - 1)

        placeholders: list[tuple[int, int]] = []  # (row, the last step's sample row that is its token)
        for sr in decodes:
            s, token = sr.start, sr.token_ids[0]
            want_logits(sr, len(positions), 1)
            if token == PLACEHOLDER_TOKEN:
                placeholders.append((len(input_ids), self.last_rows[sr.request_id]))
                token = 0
            input_ids.append(token)
            positions.append(s)
            slots.append(sr.block_ids[s // bs] * bs + s % bs)
        md = inputs.attn
        slot_parts = [torch.tensor(slots, dtype=torch.int64)] if slots else []
        for sr in prefills:
            s, n, row = sr.start, len(sr.token_ids), len(positions)
            want_logits(sr, row, n)
            input_ids.extend(sr.token_ids)
            positions.extend(range(s, s + n))
            bt = torch.tensor(sr.block_ids, dtype=torch.int64)
            pos = torch.arange(s, s + n)
            slot_parts.append(bt[pos // bs] * bs + pos % bs)
        md.slot_mapping = device_tensor(torch.cat(slot_parts) if len(slot_parts) > 1 else slot_parts[0],
                                        torch.int64, dev)
        if self.loras:
            inputs.lora = self._lora_batch(decodes + prefills)
        if self.model.vision is not None:
            inputs.mm = self._image_embeddings(decodes + prefills)
        runs = [(r.block_ids, r.start, len(r.token_ids)) for r in decodes + prefills]
        (per_token_decode_rows if self.config.batch_invariant else step_metadata)(md, runs, dev)
        inputs.input_ids = device_tensor(input_ids, torch.int64, dev)
        if placeholders:
            self._fill_placeholders(inputs.input_ids, placeholders)
        inputs.positions = device_tensor(positions, torch.int64, dev)
        return inputs

    def _fill_placeholders(self, input_ids: torch.Tensor, placeholders: list[tuple[int, int]]) -> None:
        """Write the last step's sampled ids into the rows that wait for them, on the device (no
        wait for the last step). Usually the rows are 0..n-1 on both sides: one copy."""
        n = len(placeholders)
        if all(row == i and src == i for i, (row, src) in enumerate(placeholders)):
            input_ids[:n].copy_(self.last_ids[:n])
            return
        rows, srcs = (device_tensor(v, torch.int64, self.device) for v in zip(*placeholders))
        input_ids[rows] = self.last_ids[srcs]

    # ---- routed experts -------------------------------------------------------------------
    def routed_experts(self, so: SchedulerOutput, out: ModelRunnerOutput) -> None:
        """For every request that asks and samples in this step: the routing rows of positions
        [from, computed), `from` = the first position not sent before, or lower where a recompute
        (after a preemption) went back: those rows are sent again, as recomputed. Prefill chunks
        that do not sample send nothing; their rows wait in the buffer for the sampling step, so
        one output carries one piece (first position, int16 bytes (n, num_layers, top_k))."""
        spans = []
        for sr in so.scheduled:
            state = self.requests[sr.request_id]
            if not state.params.return_routed_experts:
                continue
            state.routed_low = sr.start if state.routed_low is None else min(state.routed_low, sr.start)
            if not sr.sample:
                continue
            lo, hi = min(state.routed_sent, state.routed_low), sr.start + len(sr.token_ids)
            state.routed_sent, state.routed_low = max(state.routed_sent, hi), None
            spans.append((sr, lo, hi))
        if not spans:
            return
        bs = self.block_size
        slots = [sr.block_ids[p // bs] * bs + p % bs for sr, lo, hi in spans for p in range(lo, hi)]
        rows = self.routing[torch.tensor(slots, dtype=torch.int64, device=self.device)].cpu().numpy()  # (n, L, k)
        rows = rows.astype(ROUTING_DTYPE, copy=False)
        at = 0
        for sr, lo, hi in spans:
            out.routed_experts[sr.request_id] = (lo, rows[at:at + hi - lo].tobytes())
            at += hi - lo

    # ---- images ---------------------------------------------------------------------------
    def _image_embeddings(self, rows_in_order: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's rows that hold image placeholders, and the vision encoder's output rows for
        them (from the encoder cache, or encoded now)."""
        rows, parts, row = [], [], 0
        for sr in rows_in_order:
            start, end = sr.start, sr.start + len(sr.token_ids)
            for f in self.requests[sr.request_id].mm_features or ():
                lo, hi = bisect.bisect_left(f.positions, start), bisect.bisect_left(f.positions, end)
                if lo < hi:
                    rows.extend(row + p - start for p in f.positions[lo:hi])
                    parts.append(self._encoded(f)[lo:hi])
            row += end - start
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.int64, device=self.device), torch.cat(parts)

    def _encoded(self, f: MMFeature) -> torch.Tensor:
        self.encoder_cache_queries += 1
        emb = self.encoder_cache.get(f.hash)
        if emb is not None:
            self.encoder_cache_hits += 1
            self.encoder_cache.move_to_end(f.hash)
            return emb
        with phase("encode_images"):
            emb = self.model.vision.encode(f.pixel_values)
        assert emb.shape[0] == len(f.positions), "the frontend checked the placeholders (engine/frontend/multimodal.py)"
        limit = self.config.encoder_cache_size
        while self.encoder_cache and self.encoder_cache_rows + emb.shape[0] > limit:
            self.encoder_cache_rows -= self.encoder_cache.popitem(last=False)[1].shape[0]
        self.encoder_cache[f.hash] = emb
        self.encoder_cache_rows += emb.shape[0]
        return emb

    def reset_encoder_cache(self) -> None:
        self.encoder_cache.clear()
        self.encoder_cache_rows = 0

    # ---- LoRA adapters ------------------------------------------------------------------
    def _lora_batch(self, rows_in_order: list[ScheduledRequest]) -> LoRABatch | None:
        """Which rows of the step run with which adapter (requests are laid out in this order)."""
        ids = [self.requests[sr.request_id].lora_id for sr in rows_in_order]
        present = sorted(set(ids) - {0})
        if not present:
            return None
        for lora_id in present:  # recently used
            self.loras[lora_id] = self.loras.pop(lora_id)
        adapters = [self.loras[i] for i in present]
        if len(present) == 1 and 0 not in ids:  # one adapter on every row
            return LoRABatch(adapters, None, {})
        index = {lora_id: i for i, lora_id in enumerate(present)}
        owner = [index.get(lora_id, -1) for sr, lora_id in zip(rows_in_order, ids) for _ in sr.token_ids]
        held, _ = self._lora_stacks  # stacks stay valid while the step has the very same adapters
        if len(held) != len(adapters) or any(a is not b for a, b in zip(held, adapters)):
            self._lora_stacks = (tuple(adapters), {})
        return LoRABatch(adapters, torch.tensor(owner, device=self.device)[:, None], self._lora_stacks[1])

    def add_lora(self, request: LoRARequest, keep: list[int]) -> bool:
        """Load a PEFT adapter (checked first: a bad one changes nothing); False if already loaded.
        Beyond max_loras the least recently used adapter that `keep` does not name (the core's
        pinned adapters and those its requests use) goes."""
        c = self.config
        if not c.enable_lora:
            raise EngineStateError("LoRA is off: start the engine with enable_lora=True (--enable-lora)")
        if request.lora_int_id in self.loras:
            return False
        adapter = load_adapter(request, c.model_config, c.max_lora_rank, self.dtype, self.device, self.partition)
        if len(self.loras) >= c.max_loras:
            victim = next((i for i in self.loras if i not in keep), None)
            if victim is None:
                raise EngineStateError(f"all {c.max_loras} LoRA slots (max_loras) hold pinned or in-use adapters")
            del self.loras[victim]
        self.loras[request.lora_int_id] = adapter
        return True

    def replace_lora(self, adapter: Adapter) -> None:
        """A loaded adapter's new weights (a push; the core pins it: they exist nowhere else)."""
        self.loras[adapter.request.lora_int_id] = adapter
        self._lora_stacks = ((), {})

    def remove_lora(self, lora_id: int) -> bool:
        self._lora_stacks = ((), {})
        return self.loras.pop(lora_id, None) is not None

    def list_loras(self) -> list[int]:
        return sorted(self.loras)

    def pool(self, hidden: torch.Tensor, pool_rows: list[tuple[ScheduledRequest, int]], out: ModelRunnerOutput) -> None:
        """Encode requests: add this chunk's final hidden states to the request's pool; once the
        prompt is done, its last token's state or the mean (a classifier: the head's logits)."""
        for sr, row in pool_rows:
            state = self.requests[sr.request_id]
            rows = hidden[row:row + len(sr.token_ids)]
            if state.params.pooling == "mean":
                if sr.start == 0:  # (again after a preemption: the request is recomputed)
                    state.pool_sum = torch.zeros(rows.shape[1], dtype=torch.float32, device=rows.device)
                state.pool_sum += rows.float().sum(dim=0)
            if not sr.sample:
                continue
            if state.params.pooling == "mean":
                vec = (state.pool_sum / (sr.start + len(sr.token_ids))).to(rows.dtype)
            else:
                vec = rows[-1]
            if self.model.score is not None:
                vec = self.model.classify(vec[None])[0]
            out.pooled[sr.request_id] = vec.float().tolist()

    def _prompt_logprob_positions(self, sr: ScheduledRequest) -> range:
        """Positions p of this chunk whose logits give prompt token p + 1's logprob, not done before."""
        state = self.requests[sr.request_id]
        if state.prompt_token_ids is None:
            return range(0)
        return range(max(sr.start, state.num_prompt_logprobs),
                     max(min(sr.start + len(sr.token_ids), len(state.prompt_token_ids) - 1), 0))

    def compute_prompt_logprobs(self, logits: torch.Tensor, prompt_rows, out: ModelRunnerOutput) -> None:
        for rid, first, pos in prompt_rows:
            state = self.requests[rid]
            # raw logits (or / temperature, as the sampler divides them): p predicts p+1
            rows = logits[first:first + len(pos)].float()
            p = state.params
            if p.temp_scaled_prompt_logprobs and p.temperature > 0:  # (a float32 column, as the sampler's)
                rows = rows / torch.full((rows.shape[0], 1), p.temperature, dtype=torch.float32, device=rows.device)
            rows = log_softmax(rows, self.config.batch_invariant)
            targets = torch.tensor(state.prompt_token_ids[pos.start + 1:pos.stop + 1], dtype=torch.int64,
                                   device=rows.device)
            lps = rows.gather(1, targets[:, None]).squeeze(1).tolist()
            top = None
            k = state.params.prompt_logprobs
            if k:
                vals, ids = rows.topk(k, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            out.prompt_logprobs[rid] = (lps, top)
            state.num_prompt_logprobs = pos.stop

    def sample(self, logits: torch.Tensor, samplers: list[ScheduledRequest], out: ModelRunnerOutput,
               read_back: list[Callable[[], None]]) -> None:
        """Draw the samplers' tokens into `out`. The copies to the host start here (on a GPU, into
        pinned memory behind an event); what waits for them is appended to `read_back`, and reads
        nothing the next step may change (it can run while that step is being prepared)."""
        states = [self.requests[sr.request_id] for sr in samplers]
        res = sample(logits, self._sampling_metadata(samplers, states), self.generator)
        self.last_ids, self.last_rows = res.token_ids, {sr.request_id: i for i, sr in enumerate(samplers)}
        if res.kept_sets:
            for i, kept in res.kept_sets.items():
                out.sampling_masks[samplers[i].request_id] = SamplingMask(*kept)
        ids, lps, top_ids, top_lps = (None if t is None else t.to("cpu", non_blocking=True)
                                      for t in (res.token_ids, res.logprobs, res.top_ids, res.top_logprobs))
        copied = None
        if res.token_ids.is_cuda:
            copied = torch.cuda.Event()
            copied.record()
        ks = [state.params.logprobs for state in states]
        read_back.append(functools.partial(self.samples_to_host, out, samplers, ks, copied, ids, lps, top_ids, top_lps))

    @staticmethod
    def samples_to_host(out: ModelRunnerOutput, samplers: list[ScheduledRequest], ks: list[int | None],
                        copied, ids: torch.Tensor, lps, top_ids, top_lps) -> None:
        """sample()'s second half: wait for the copies (`copied`: a CUDA event, or None) and write the
        tokens and the logprobs that were asked for (ks: each sampler's top-k, None for none) into `out`."""
        if copied is not None:
            copied.synchronize()
        for sr, t in zip(samplers, ids.tolist()):
            out.sampled[sr.request_id] = t
        if lps is None:
            return
        lp_list = lps.tolist()
        top_id_list = top_ids.tolist() if top_ids is not None else None
        top_lp_list = top_lps.tolist() if top_ids is not None else None
        for i, (sr, k) in enumerate(zip(samplers, ks)):
            if k is None:
                continue
            out.logprobs[sr.request_id] = lp_list[i]
            if k:
                out.top_logprobs[sr.request_id] = list(zip(top_id_list[i][:k], top_lp_list[i][:k]))

    def _sampling_metadata(self, samplers: list[ScheduledRequest],
                           states: list[CachedRequestState]) -> SamplingMetadata:
        ps = [s.params for s in states]
        md = SamplingMetadata(num_rows=len(ps), all_greedy=all(p.temperature == 0 for p in ps),
                              batch_invariant=self.config.batch_invariant)
        dev = self.device
        if not md.all_greedy:
            md.temperature = device_tensor([p.temperature or 1.0 for p in ps], torch.float32, dev)
            if any(p.temperature == 0 for p in ps):
                md.greedy = device_tensor([p.temperature == 0 for p in ps], torch.bool, dev)
            if any(p.top_k > 0 for p in ps):
                md.top_k = device_tensor([p.top_k for p in ps], torch.int64, dev)
            if any(p.top_p < 1 for p in ps):
                md.top_p = device_tensor([p.top_p for p in ps], torch.float32, dev)
            if any(p.min_p > 0 for p in ps):
                md.min_p = device_tensor([p.min_p for p in ps], torch.float32, dev)
            md.generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        want = [p.logprobs for p in ps if p.logprobs is not None]
        if want:
            md.max_num_logprobs = max(want)
            if any(p.logprobs is not None and p.logprobs_mode == "raw" for p in ps):
                md.raw_logprobs = device_tensor([p.logprobs_mode == "raw" for p in ps], torch.bool, dev)
        md.banned_tokens = {i: sr.banned_token_ids for i, sr in enumerate(samplers) if sr.banned_token_ids}
        masks = {i: p.return_sampling_mask == "ids" for i, p in enumerate(ps) if p.return_sampling_mask}
        if masks:
            md.mask_rows, md.mask_max_ids = masks, MAX_SAMPLING_MASK_IDS
        return md
