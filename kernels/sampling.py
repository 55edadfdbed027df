"""Token sampling on a batch of logits: temperature, top-k, top-p, min-p (in Hugging Face's
order), greedy rows, per-row seeded generators, and logprobs of the sampled tokens plus top-k.

Sampling inverts the CDF with one uniform number per row, so a seeded row draws from its own
generator without touching the others. The CDF is searched in two levels (chunk sums, then one
chunk's cumulative sum): one pass over the probabilities instead of a full cumulative sum or
a vocabulary's worth of random numbers (torch's exponential_ / multinomial cost ~80 ms for
32 x 49152 on this CPU, this ~1 ms).

Kept sets (rows in SamplingMetadata.mask_rows, engine's return_sampling_mask): the tokens the
filters left each row to draw from, read off the very tensor the row was drawn from, so the
export is what the sampler did. Such a batch takes the torch path (on CUDA too) with a stable
top-p sort, so a cut through equal logits keeps the lower token ids, as the Triton sampler does;
torch's default sort leaves that choice unspecified, and costs ~15% less, so other batches keep it.
"""
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import cpu_ext
from .norm import triton_available

CDF_CHUNK = 1024


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters for a batch of N rows (the model runner builds it)."""

    num_rows: int
    all_greedy: bool
    temperature: torch.Tensor | None = None  # (N,) float32; greedy rows hold 1.0
    greedy: torch.Tensor | None = None  # (N,) bool; None when no row is greedy
    top_k: torch.Tensor | None = None  # (N,) int64, 0 = off; None when no row filters
    top_p: torch.Tensor | None = None  # (N,) float32, 1 = off
    min_p: torch.Tensor | None = None  # (N,) float32, 0 = off
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded rows
    max_num_logprobs: int | None = None  # None: no row wants logprobs
    raw_logprobs: torch.Tensor | None = None  # (N,) bool rows that want raw-logit logprobs
    banned_tokens: dict[int, list[int]] = field(default_factory=dict)  # row -> ids (min_tokens)
    batch_invariant: bool = False  # logsumexp in one fixed order per row (see logsumexp)
    mask_rows: dict[int, bool] | None = None  # rows that export their kept set -> with its ids
    mask_max_ids: int = 0  # ids of a kept set larger than this are not listed


class KeptSet(NamedTuple):
    """One row's kept set (engine.protocol.SamplingMask says what each field means)."""

    num_kept: int
    min_logprob: float
    kept_logmass: float
    ids: list[int] | None


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # (N,) int64
    logprobs: torch.Tensor | None = None  # (N,) float32
    top_ids: torch.Tensor | None = None  # (N, k) int64
    top_logprobs: torch.Tensor | None = None  # (N, k) float32
    kept_sets: dict[int, KeptSet] | None = None  # the rows of md.mask_rows


def greedy_ref(logits: torch.Tensor, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """First argmax per row of (N, V) logits and (optionally) its log-softmax, in float32."""
    x = logits.float()
    ids = x.argmax(dim=-1)
    if not with_logprobs:
        return ids, None
    return ids, (x.gather(1, ids[:, None]) - torch.logsumexp(x, dim=-1, keepdim=True)).squeeze(1)


def greedy(logits: torch.Tensor, with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """greedy_ref in one pass: the C++ op on CPU, the Triton kernel (kernels/triton_sampling.py)
    on CUDA; bf16 logits read as they are, no float32 copy."""
    if logits.ndim == 2 and logits.stride(-1) == 1:
        ext = cpu_ext.ops_for(logits.device, logits.dtype)
        if ext is not None:
            ids, lps = ext.greedy_logprobs(logits, with_logprobs)
            return ids, lps if with_logprobs else None
        if logits.is_cuda and triton_available():
            from kernels import triton_sampling

            return triton_sampling.greedy(logits, with_logprobs)
    return greedy_ref(logits, with_logprobs)


def logsumexp(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """(N, V) float32 -> (N, 1). invariant: the C++ op that sums each row on one thread in one
    fixed order (torch's reduction splits a lone row across threads, so its bits depend on N)."""
    if invariant:
        return cpu_ext.ops_for(x.device, x.dtype).logsumexp_rows(x)[:, None]
    return torch.logsumexp(x, dim=-1, keepdim=True)


def log_softmax(x: torch.Tensor, invariant: bool) -> torch.Tensor:
    """(N, V) float32 log-softmax; invariant as in logsumexp."""
    return x - logsumexp(x, True) if invariant else x.log_softmax(dim=-1)


def sample(logits: torch.Tensor, md: SamplingMetadata, generator: torch.Generator | None = None) -> SamplerOutput:
    """logits: (N, V) float32 or the model's dtype (converted to float32 unless the batch is plain
    greedy), modified in place by banned tokens. Returns sampled ids + logprobs."""
    # (greedy_logprobs' -log(sum) may differ in the last bit from gather - logsumexp below, which
    # every batch-invariant row that wants logprobs must get, whatever its batch)
    invariant_logprobs = md.batch_invariant and md.max_num_logprobs is not None
    if (md.all_greedy and not md.banned_tokens and not md.max_num_logprobs and not invariant_logprobs
            and not md.mask_rows):
        ids, lps = greedy(logits, md.max_num_logprobs is not None)
        return SamplerOutput(token_ids=ids, logprobs=lps)
    if _triton_sampler_fits(logits, md):
        return _sample_triton(logits, md, generator)
    if (ext := _cpu_sampler(logits, md)) is not None:
        return _sample_cpu(ext, logits, md, generator)
    logits = logits.float()
    for row, ids in md.banned_tokens.items():
        logits[row, ids] = float("-inf")
    if md.all_greedy:
        scaled = processed = logits
        token_ids = logits.argmax(dim=-1)
    else:
        scaled = logits / md.temperature[:, None]
        processed = filter_logits(scaled, md)  # (a new tensor when a filter is on: scaled stays whole)
        token_ids = sample_from_probs(processed.softmax(dim=-1), _uniforms(md, generator, logits.device))
        if md.greedy is not None:
            token_ids = torch.where(md.greedy, logits.argmax(dim=-1), token_ids)
    out = SamplerOutput(token_ids=token_ids)
    if md.mask_rows:
        out.kept_sets = kept_sets(scaled, processed, token_ids, md)
    if md.max_num_logprobs is not None:
        src = processed
        if md.raw_logprobs is not None:
            src = torch.where(md.raw_logprobs[:, None], logits, processed)
        lse = logsumexp(src, md.batch_invariant)  # (N, 1)
        out.logprobs = (src.gather(1, token_ids[:, None]) - lse).squeeze(1)
        if md.max_num_logprobs > 0:
            vals, out.top_ids = src.topk(md.max_num_logprobs, dim=-1)
            out.top_logprobs = vals - lse
    return out


def _uniforms(md: SamplingMetadata, generator: torch.Generator | None, device) -> torch.Tensor:
    """One uniform number per row; a seeded row's from its own generator. A generator draws on its
    own device (a request's seeded one lives on the host, so a seed gives the same draws on a CPU
    and a GPU engine); the numbers then move to the logits' device."""
    u = torch.rand(md.num_rows, generator=generator, device=generator.device if generator is not None else device)
    for row, g in md.generators.items():
        u[row] = torch.rand(1, generator=g, device=g.device)[0]
    return u.to(device)


def _triton_sampler_fits(logits: torch.Tensor, md: SamplingMetadata) -> bool:
    """The Triton sampler (CUDA) returns ids and the sampled token's logprob under the filtered
    distribution: not top-k logprob lists, raw-logit logprobs or batch-invariant sums."""
    return (logits.is_cuda and logits.ndim == 2 and logits.stride(-1) == 1 and not md.all_greedy
            and not md.max_num_logprobs and md.raw_logprobs is None and not md.batch_invariant
            and not md.mask_rows and triton_available())


def _sample_triton(logits: torch.Tensor, md: SamplingMetadata, generator: torch.Generator | None) -> SamplerOutput:
    """sample() through kernels/triton_sampling.py: one pass set per row, no sort, no float32
    copy of the logits. Greedy rows take the greedy kernel's argmax and logprob (their filters
    are off, so the filtered distribution is the raw one)."""
    from kernels import triton_sampling

    for row, ids in md.banned_tokens.items():
        logits[row, ids] = float("-inf")
    N, dev = md.num_rows, logits.device
    top_k = md.top_k if md.top_k is not None else torch.zeros(N, dtype=torch.int64, device=dev)
    top_p = md.top_p if md.top_p is not None else torch.ones(N, device=dev)
    min_p = md.min_p if md.min_p is not None else torch.zeros(N, device=dev)
    with_logprobs = md.max_num_logprobs is not None
    ids, lps = triton_sampling.sample(logits, md.temperature, top_k, top_p, min_p, _uniforms(md, generator, dev),
                                      with_logprobs)
    if md.greedy is not None:
        g_ids, g_lps = triton_sampling.greedy(logits, with_logprobs)
        ids = torch.where(md.greedy, g_ids, ids)
        if with_logprobs:
            lps = torch.where(md.greedy, g_lps, lps)
    return SamplerOutput(token_ids=ids, logprobs=lps)


def _cpu_sampler(logits: torch.Tensor, md: SamplingMetadata):
    """The C++ op module when its sample_rows serves this batch (CPU; temperature only, no top-k /
    top-p / min-p; no logprobs or only the sampled token's, and then no greedy rows among the
    sampled ones; not batch-invariant mode, whose logprobs take logsumexp_rows; no kept sets), else None."""
    if (logits.ndim != 2 or logits.stride(-1) != 1 or md.all_greedy or md.top_k is not None
            or md.top_p is not None or md.min_p is not None or md.max_num_logprobs not in (None, 0)
            or md.raw_logprobs is not None or md.batch_invariant or md.mask_rows
            or (md.greedy is not None and md.max_num_logprobs is not None)):
        return None
    return cpu_ext.ops_for(logits.device, logits.dtype)


def _sample_cpu(ext, logits: torch.Tensor, md: SamplingMetadata, generator: torch.Generator | None) -> SamplerOutput:
    """sample() through the C++ op: the torch path's draw (same u, same two-level CDF search) in
    three passes over each row, without float32 copies of the logits (~4 ms -> ~0.5 ms a step
    at 32 x 49152)."""
    for row, ids in md.banned_tokens.items():
        logits[row, ids] = float("-inf")
    with_logprobs = md.max_num_logprobs is not None
    ids, lps = ext.sample_rows(logits, md.temperature, _uniforms(md, generator, logits.device), with_logprobs)
    if md.greedy is not None:  # (no logprobs then: see _cpu_sampler)
        ids = torch.where(md.greedy, logits.argmax(dim=-1), ids)
    return SamplerOutput(token_ids=ids, logprobs=lps if with_logprobs else None)


def kept_sets(scaled: torch.Tensor, processed: torch.Tensor, token_ids: torch.Tensor,
              md: SamplingMetadata) -> dict[int, KeptSet]:
    """The kept set of every row in md.mask_rows. scaled: (N, V) logits / temperature (raw logits
    for greedy rows, whose temperature reads 1), banned tokens at -inf; processed: scaled after
    the filters (-inf = dropped); token_ids: (N,) what was drawn. A greedy row keeps its argmax."""
    rows = sorted(md.mask_rows)
    index = torch.tensor(rows, dtype=torch.int64, device=scaled.device)
    x = scaled.index_select(0, index)  # (R, V)
    kept = processed.index_select(0, index) > float("-inf")
    greedy = [i for i, r in enumerate(rows) if md.all_greedy or (md.greedy is not None and bool(md.greedy[r]))]
    if greedy:
        g = torch.tensor(greedy, dtype=torch.int64, device=x.device)
        kept[g] = False
        kept[g, token_ids.index_select(0, index[g])] = True
    kept_x = x.masked_fill(~kept, float("-inf"))  # (for a sampled row: processed's row, bit for bit)
    lse = logsumexp(x, md.batch_invariant)  # (R, 1)
    kept_logmass = (logsumexp(kept_x, md.batch_invariant) - lse).squeeze(1)
    min_logprob = (x.masked_fill(~kept, float("inf")).min(dim=-1).values[:, None] - lse).squeeze(1)
    num_kept = kept.sum(dim=-1)
    out = {}
    for i, (r, n, lo, mass) in enumerate(zip(rows, num_kept.tolist(), min_logprob.tolist(), kept_logmass.tolist())):
        ids = None
        if md.mask_rows[r] and n <= md.mask_max_ids:
            ids_up = kept[i].nonzero().squeeze(1)  # ascending ids; a stable sort keeps that order in ties
            ids = ids_up[x[i, ids_up].sort(descending=True, stable=True).indices].tolist()
        out[r] = KeptSet(n, lo, mass, ids)
    return out


def sample_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids (N,) drawn from probs (N, V) by inverse CDF at u (N,) uniform in [0, 1)."""
    N, V = probs.shape
    C = min(CDF_CHUNK, V)
    padded = (F.pad(probs, (0, (-V) % C)) if V % C else probs).view(N, -1, C)  # (N, num_chunks, C)
    cum = padded.sum(dim=-1).cumsum(dim=-1)  # (N, num_chunks)
    target = (u * cum[:, -1])[:, None]  # (N, 1)
    chunk = torch.searchsorted(cum, target, right=True).clamp(max=cum.shape[1] - 1)  # (N, 1)
    before = torch.where(chunk > 0, cum.gather(1, (chunk - 1).clamp(min=0)), torch.zeros_like(target))
    inner = padded.gather(1, chunk[:, :, None].expand(N, 1, C)).squeeze(1).cumsum(dim=-1)  # (N, C)
    j = torch.searchsorted(inner, target - before, right=True).clamp(max=C - 1)
    ids = chunk * C + j  # (N, 1)
    # float rounding between the two sums can land past the chunk's last nonzero token
    ids = ids.squeeze(1).clamp(max=V - 1)
    bad = probs.gather(1, ids[:, None]).squeeze(1) <= 0
    if bad.any():
        ids[bad] = probs[bad].argmax(dim=-1)
    return ids


def filter_logits(x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Mask (to -inf) the tokens that top-k, then top-p, then min-p exclude. x: (N, V), in place."""
    neg_inf = float("-inf")
    if md.top_p is not None:
        # One descending sort serves both top-k (rank >= k) and top-p (mass before it >= p).
        sorted_x, order = x.sort(dim=-1, descending=True, stable=bool(md.mask_rows))
        if md.top_k is not None:
            ranks = torch.arange(x.shape[1], device=x.device)[None, :]
            sorted_x.masked_fill_((md.top_k[:, None] > 0) & (ranks >= md.top_k[:, None]), neg_inf)
        probs = sorted_x.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= md.top_p[:, None]) & (md.top_p[:, None] < 1)  # top_p 1: keep the tail
        drop[:, 0] = False
        x = x.scatter(1, order, sorted_x.masked_fill(drop, neg_inf))
    elif md.top_k is not None:
        top_k = md.top_k.clamp(max=x.shape[1])  # k beyond the vocabulary keeps everything
        kth = x.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k.clamp(min=1) - 1)[:, None])
        kth = torch.where(top_k[:, None] > 0, kth, torch.full_like(kth, neg_inf))
        x = x.masked_fill(x < kth, neg_inf)
    if md.min_p is not None:
        probs = x.softmax(dim=-1)
        x = x.masked_fill(probs < md.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, neg_inf)
    return x


def sample_ref_filter(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
                      stable: bool = False) -> torch.Tensor:
    """Readable single-row reference of filter_logits (after temperature) for tests: (V,) -> (V,).
    stable: ties in top-p's sort keep vocabulary order (the Triton sampler's rule; torch's sort
    leaves their order unspecified, so which of the tokens tied at the cut survive is too)."""
    x = logits / temperature
    if top_k > 0:
        x = torch.where(x < torch.topk(x, top_k).values[-1], torch.tensor(float("-inf")), x)
    if top_p < 1:
        sorted_x, order = x.sort(descending=True, stable=True) if stable else x.sort(descending=True)
        p = sorted_x.softmax(-1)
        keep_sorted = (p.cumsum(-1) - p) < top_p
        keep = torch.zeros_like(keep_sorted)
        keep[order] = keep_sorted
        x = torch.where(keep, x, torch.tensor(float("-inf")))
    if min_p > 0:
        p = x.softmax(-1)
        x = torch.where(p < min_p * p.max(), torch.tensor(float("-inf")), x)
    return x


def sample_filtered_ref(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                        min_p: torch.Tensor, u: torch.Tensor,
                        with_logprobs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Reference of the Triton sampler (kernels/triton_sampling.py `sample`, same arguments): per row
    x = logits / temperature (float32), sample_ref_filter (ties at the k-th value kept, top-p ties in
    vocabulary order), sample_from_probs at u, and the logprob under the filtered distribution."""
    x = logits.float() / temperature[:, None]
    V = x.shape[1]
    x = torch.stack([sample_ref_filter(row, 1.0, min(k, V), p, mp, stable=True)
                     for row, k, p, mp in zip(x, top_k.tolist(), top_p.tolist(), min_p.tolist())])
    ids = sample_from_probs(x.softmax(dim=-1), u)
    if not with_logprobs:
        return ids, None
    return ids, (x.gather(1, ids[:, None]) - torch.logsumexp(x, dim=-1, keepdim=True)).squeeze(1)
