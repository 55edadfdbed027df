"""ModelRunner: turns a SchedulerOutput into one forward pass and sampled tokens.

It owns the model weights and the KV cache tensors; it reads the scheduled requests' token
ids and block ids, and never touches scheduling state.
"""
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from engine.attention import AttentionMetadata, PrefillChunk, prefill_mask
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.model import LlamaModel
from engine.request import Request
from engine.scheduler import SchedulerOutput
from kernels.sampling import SamplingMetadata, sample

GiB = 1 << 30
CPU_DEFAULT_KV_CACHE_MEMORY = 2 * GiB


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, float] = field(default_factory=dict)
    top_logprobs: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    # request id -> (logprobs of prompt tokens, top-k per prompt token) for this chunk
    prompt_logprobs: dict[str, tuple[list[float], Optional[list]]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        mc = config.model_config
        t = time.perf_counter()
        if self.device.type == "cpu":
            from kernels import cpu_ext

            cpu_ext.load()  # build the C++ kernels now (once per machine), not in the first request
        self.model = LlamaModel(mc, self.dtype, self.device, config.max_model_len)
        self.model.load_safetensors(config.model)
        self.load_seconds = time.perf_counter() - t
        self.generator = torch.Generator(device=self.device).manual_seed(config.seed)
        self.kv_cache: Optional[torch.Tensor] = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.weights_valid = True  # False after a level-2 sleep until a push or reload

    # ---- KV cache -----------------------------------------------------------------------
    def kv_cache_bytes(self) -> int:
        c = self.config
        if c.kv_cache_memory is not None:
            return int(c.kv_cache_memory)
        if self.device.type == "cpu":
            return CPU_DEFAULT_KV_CACHE_MEMORY
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        activations = 2 * c.max_num_batched_tokens * c.model_config.vocab_size * 4  # logits dominate
        return max(int(total * c.gpu_memory_utilization) - used - activations, 0)

    def init_kv_cache(self) -> int:
        """Allocate the cache; returns the number of blocks. Pages are touched only as used (CPU)."""
        mc, bs = self.config.model_config, self.block_size
        if not self.num_blocks:
            per_block = self.config.kv_bytes_per_token() * bs
            self.num_blocks = self.kv_cache_bytes() // per_block
            if self.num_blocks < 1:
                raise ValueError(f"kv_cache_memory too small: one block needs {per_block} bytes")
        self.kv_cache = torch.empty(mc.num_layers, 2, self.num_blocks, bs, mc.num_kv_heads, mc.head_dim,
                                    dtype=self.dtype, device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(mc.num_layers)]
        return self.num_blocks

    def free_kv_cache(self) -> None:
        self.kv_cache, self.kv_caches = None, []

    # ---- one step -----------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, so: SchedulerOutput, kv: KVCacheManager) -> ModelRunnerOutput:
        assert self.kv_cache is not None and self.weights_valid, "executing while asleep"
        bs = self.block_size
        # decodes first (one token each), then prefill chunks
        decodes = [(r, n) for r, n in so.scheduled if n == 1]
        prefills = [(r, n) for r, n in so.scheduled if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        table: list[list[int]] = []
        seq_lens: list[int] = []
        logit_rows: list[int] = []  # rows whose logits are needed
        samplers: list[Request] = []  # requests that sample a token this step, in logit-row order
        prompt_lp: list[tuple[Request, int, int]] = []  # (req, first logit row, num rows)
        for req, _ in decodes:
            s = req.num_computed_tokens
            blocks = kv.block_ids(req.request_id)
            input_ids.append(req.all_token_ids[s])
            positions.append(s)
            slots.append(blocks[s // bs] * bs + s % bs)
            table.append(blocks)
            seq_lens.append(s + 1)
            if req.prompt_logprobs is not None and s + 1 < req.num_prompt_tokens:
                prompt_lp.append((req, len(logit_rows), 1))
                logit_rows.append(len(positions) - 1)
            elif s + 1 == req.num_tokens:
                logit_rows.append(len(positions) - 1)
                samplers.append(req)
        md = AttentionMetadata(slot_mapping=None, num_decodes=len(decodes))
        slot_parts = [torch.tensor(slots, dtype=torch.int64)] if slots else []
        window = self.config.model_config.sliding_window
        for req, n in prefills:
            s = req.num_computed_tokens
            row = len(positions)
            blocks = kv.block_ids(req.request_id)
            input_ids.extend(req.all_token_ids[s:s + n])
            positions.extend(range(s, s + n))
            bt = torch.tensor(blocks, dtype=torch.int64)
            pos = torch.arange(s, s + n)
            slot_parts.append(bt[pos // bs] * bs + pos % bs)
            md.prefills.append(PrefillChunk(q_start=row, q_len=n, seq_len=s + n,
                                            block_ids=bt.to(self.device) if s else None,
                                            mask=prefill_mask(s, n, window, self.device)))
            if req.prompt_logprobs is not None:
                last = min(s + n, req.num_prompt_tokens - 1)  # positions < last predict prompt tokens
                if last > s:
                    prompt_lp.append((req, len(logit_rows), last - s))
                    logit_rows.extend(range(row, row + last - s))
            if s + n == req.num_tokens:
                logit_rows.append(row + n - 1)
                samplers.append(req)
        dev = self.device
        md.slot_mapping = torch.cat(slot_parts).to(dev) if len(slot_parts) > 1 else slot_parts[0].to(dev)
        if decodes:
            width = max(len(b) for b in table)
            md.decode_block_table = torch.tensor([b + [0] * (width - len(b)) for b in table],
                                                 dtype=torch.int32, device=dev)
            md.decode_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
        ids_t = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        hidden = self.model.forward(ids_t, pos_t, md, self.kv_caches)
        if len(logit_rows) < len(positions):
            hidden = hidden[torch.tensor(logit_rows, dtype=torch.int64, device=dev)]
        logits = self.model.compute_logits(hidden)  # (len(logit_rows), V) in the model's dtype
        out = ModelRunnerOutput()
        if prompt_lp:
            self._prompt_logprobs(logits, prompt_lp, out)
        if samplers:
            n_prompt_rows = len(logit_rows) - len(samplers)
            sample_logits = logits if not n_prompt_rows else logits[self._sampler_rows(prompt_lp, len(logit_rows))]
            self._sample(sample_logits, samplers, out)
        return out

    @staticmethod
    def _sampler_rows(prompt_lp, num_rows) -> torch.Tensor:
        skip = set()
        for _, first, n in prompt_lp:
            skip.update(range(first, first + n))
        return torch.tensor([i for i in range(num_rows) if i not in skip], dtype=torch.int64)

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_lp, out: ModelRunnerOutput) -> None:
        for req, first, n in prompt_lp:
            s = req.num_computed_tokens
            rows = logits[first:first + n].float().log_softmax(dim=-1)  # raw logits: position p predicts p+1
            targets = torch.tensor(req.all_token_ids[s + 1:s + 1 + n], dtype=torch.int64, device=rows.device)
            lps = rows.gather(1, targets[:, None]).squeeze(1).tolist()
            top = None
            k = req.params.prompt_logprobs
            if k:
                vals, ids = rows.topk(k, dim=-1)
                top = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            out.prompt_logprobs[req.request_id] = (lps, top)

    def _sample(self, logits: torch.Tensor, reqs: list[Request], out: ModelRunnerOutput) -> None:
        md = self._sampling_metadata(reqs)
        res = sample(logits, md, self.generator)
        token_ids = res.token_ids.tolist()
        for req, t in zip(reqs, token_ids):
            out.sampled[req.request_id] = t
        if res.logprobs is not None:
            lps = res.logprobs.tolist()
            top_ids = res.top_ids.tolist() if res.top_ids is not None else None
            top_lps = res.top_logprobs.tolist() if res.top_ids is not None else None
            for i, req in enumerate(reqs):
                k = req.params.logprobs
                if k is None:
                    continue
                out.logprobs[req.request_id] = lps[i]
                if k:
                    out.top_logprobs[req.request_id] = list(zip(top_ids[i][:k], top_lps[i][:k]))

    def _sampling_metadata(self, reqs: list[Request]) -> SamplingMetadata:
        ps = [r.params for r in reqs]
        n = len(ps)
        md = SamplingMetadata(num_rows=n, all_greedy=all(p.temperature == 0 for p in ps))
        dev = self.device
        if not md.all_greedy:
            md.temperature = torch.tensor([p.temperature or 1.0 for p in ps], dtype=torch.float32, device=dev)
            if any(p.temperature == 0 for p in ps):
                md.greedy = torch.tensor([p.temperature == 0 for p in ps], device=dev)
            if any(p.top_k > 0 for p in ps):
                md.top_k = torch.tensor([p.top_k for p in ps], dtype=torch.int64, device=dev)
            if any(p.top_p < 1 for p in ps):
                md.top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
            if any(p.min_p > 0 for p in ps):
                md.min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
            md.generators = {i: r.generator for i, r in enumerate(reqs) if r.generator is not None}
        want = [p.logprobs for p in ps if p.logprobs is not None]
        if want:
            md.max_num_logprobs = max(want)
            if any(p.logprobs is not None and p.logprobs_mode == "raw" for p in ps):
                md.raw_logprobs = torch.tensor([p.logprobs_mode == "raw" for p in ps], device=dev)
        for i, r in enumerate(reqs):
            if r.num_chunk_output_tokens < r.params.min_tokens and r.stop_ids:
                md.banned_tokens[i] = sorted(r.stop_ids)
        return md
