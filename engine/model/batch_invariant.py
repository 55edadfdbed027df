"""Batch-invariant mode, and the recompute that gives a trainer the same bits.

With `EngineConfig(batch_invariant=True)` (`rollout serve --batch-invariant`; float32 on CPU) a
token's logits, and so its logprobs, do not depend on what else the engine runs: the same prompt
alone, in a batch of 64, prefilled in one chunk or several, or found in the prefix cache, gives
bit-identical prompt and sample logprobs (and the same greedy tokens). How:
  - every projection (qkv, o, gate_up, down, lm_head) sums each output as one chain of FMAs in k
    order, whatever the number of rows, where BLAS picks its blocking and threading by it: the
    float32 panels (kernels/csrc/f32_linear.cpp, the default float32 path's kernel on AVX2 or
    AVX-512 CPUs) or, on a CPU without them, `invariant_linear` on the plain weight
    (kernels/csrc/invariant_ops.cpp), which gives the same bits;
  - attention runs every token, prefill tokens included, as its own row of the paged decode
    kernel (engine.model.attention.per_token_decode_rows): one fixed-order sum over keys 0..p;
  - the per-row C++ ops (RMSNorm, rotary, SiLU) already compute each row on its own;
  - log-softmax uses `logsumexp_rows`, one row per thread in one order (torch splits a lone row).

`InvariantScorer` runs that same forward on a trainer's weights, so the logprobs it returns are
bit-identical to the engine's for the same weights and tokens: the trainer's pi_old equals the
sampler's, and a mismatch between them is a bug, not rounding. The logprob is the log-softmax of
logits / temperature, which is what the engine reports for `logprobs_mode="raw"` (temperature 1),
or for "processed" when the request uses no top-k / top-p / min-p.

Cost: see the README (benchmarks/throughput.py --batch-invariant).
"""
from collections.abc import Iterable, Mapping

import torch

from engine.config import ModelConfig
from engine.errors import InvalidRequestError
from engine.model.attention import AttentionMetadata, per_token_decode_rows
from engine.model.decoder import LlamaModel
from kernels.sampling import logsumexp


class InvariantScorer:
    """Per-token logprobs of whole sequences through the engine's batch-invariant forward.

        scorer = InvariantScorer(model_folder)          # the folder the server serves
        scorer.load_state_dict(policy.state_dict())     # after each optimizer step (HF names)
        lps = scorer.token_logprobs([prompt + completion, ...])  # lps[i][t-1] = log p(tok_t | tok_<t)
    """

    def __init__(self, model: str | None = None, *, max_model_len: int | None = None, block_size: int = 16,
                 max_tokens_per_forward: int = 2048):
        if model is None:
            from engine.default_model import resolve_model

            model = resolve_model(None)
        self.config = ModelConfig.from_folder(model)
        self.max_len = max_model_len or self.config.max_position_embeddings
        self.block_size, self.max_tokens = block_size, max_tokens_per_forward
        self.model = LlamaModel(self.config, torch.float32, torch.device("cpu"), self.max_len, batch_invariant=True)
        self.model.load_weights(model)

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy a trainer's weights in by Hugging Face names (`model.state_dict()` or
        `named_parameters()`); every tensor is checked before any is written."""
        staged = {n: t.detach() for n, t in (state.items() if isinstance(state, Mapping) else state)}
        for name, t in staged.items():
            self.model.check_weight(name, tuple(t.shape))
        self.model.untie_pushed(staged)
        for name, t in staged.items():
            self.model.hf_view(name).copy_(t)
        self.model.repack()

    @torch.inference_mode()
    def token_logprobs(self, sequences: list[list[int]], temperature: float = 1.0) -> list[torch.Tensor]:
        """For each sequence of n token ids, an (n - 1,) float32 tensor: entry t - 1 is the
        logprob of token t given tokens 0..t-1 under logits / temperature."""
        if not temperature > 0:
            raise InvalidRequestError(f"temperature must be > 0, got {temperature}")
        for i, seq in enumerate(sequences):
            if not 1 <= len(seq) <= self.max_len:
                raise InvalidRequestError(f"sequence {i} has {len(seq)} tokens (1..{self.max_len} allowed)")
        out: list[torch.Tensor] = []
        for group in self._groups(sequences):
            out.extend(self._score(group, temperature))
        return out

    def _groups(self, sequences: list[list[int]]) -> Iterable[list[list[int]]]:
        """Consecutive sequences of at most max_tokens tokens in all (a longer one alone)."""
        group, size = [], 0
        for seq in sequences:
            if group and size + len(seq) > self.max_tokens:
                yield group
                group, size = [], 0
            group.append(seq)
            size += len(seq)
        if group:
            yield group

    def _score(self, seqs: list[list[int]], temperature: float) -> list[torch.Tensor]:
        mc, bs = self.config, self.block_size
        blocks, first = [], 0  # each sequence's own blocks in one cache for the group
        for seq in seqs:
            n = -(-len(seq) // bs)
            blocks.append(list(range(first, first + n)))
            first += n
        shape = (first, bs, mc.num_kv_heads, mc.head_dim)
        kv = [(torch.empty(shape), torch.empty(shape)) for _ in range(mc.num_layers)]
        hidden = [torch.empty(len(seq), mc.hidden_size) for seq in seqs]
        # Forward steps of <= max_tokens tokens; a sequence longer than that continues in the next
        # step (its keys are in the cache), as a chunked prefill would.
        pieces, size = [], 0
        for i, seq in enumerate(seqs):
            start = 0
            while start < len(seq):
                n = min(len(seq) - start, self.max_tokens - size)
                pieces.append((i, start, n))
                start, size = start + n, size + n
                if size == self.max_tokens:
                    self._forward(seqs, blocks, pieces, kv, hidden)
                    pieces, size = [], 0
        if pieces:
            self._forward(seqs, blocks, pieces, kv, hidden)
        out = []
        for seq, h in zip(seqs, hidden):
            lps = torch.empty(len(seq) - 1)
            targets = torch.tensor(seq[1:])
            for r in range(0, len(seq) - 1, 256):  # logits of 256 rows at a time (vocab-wide rows)
                rows = slice(r, min(r + 256, len(seq) - 1))
                x = self.model.compute_logits(h[rows])
                if temperature != 1.0:  # as the sampler: divided by a float32 per-row tensor
                    x = x / torch.full((x.shape[0],), temperature, dtype=torch.float32)[:, None]
                lps[rows] = (x.gather(1, targets[rows, None]) - logsumexp(x, True)).squeeze(1)
            out.append(lps)
        return out

    def _forward(self, seqs, blocks, pieces, kv, hidden) -> None:
        bs = self.block_size
        ids = torch.tensor([t for i, s, n in pieces for t in seqs[i][s:s + n]])
        positions = torch.cat([torch.arange(s, s + n) for _, s, n in pieces])
        slots = torch.cat([torch.tensor(blocks[i])[torch.arange(s, s + n) // bs] * bs + torch.arange(s, s + n) % bs
                           for i, s, n in pieces])
        md = AttentionMetadata(slot_mapping=slots)
        per_token_decode_rows(md, [(blocks[i], s, n) for i, s, n in pieces], ids.device)
        h = self.model.forward(ids, positions, md, kv)
        row = 0
        for i, s, n in pieces:
            hidden[i][s:s + n] = h[row:row + n]
            row += n
