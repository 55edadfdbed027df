"""Logprobs as the OpenAI routes answer them (a leaf of rollout/api, like output_json.py):
completions' {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, chat's {"content":
[{"token", "logprob", "bytes", "top_logprobs"}]}, and vLLM's per-position `prompt_logprobs`
[null, {"<id>": {"logprob", "rank", "decoded_token"}}, ...] (what TRL's get_sequence_logprobs reads).

A token is labelled by its text, or by "token_id:<id>" when a request asks vLLM's
`return_tokens_as_token_ids` (a trainer needs ids: two ids can decode to the same text, and a
token that ends inside a UTF-8 character decodes to U+FFFD).

Ranks (vLLM's `rank`, 1 = most likely): the engine hands back the top-k of each prompt position
and the actual token's logprob, not the actual token's place in the whole vocabulary. A top-k
entry's rank is its place among them; an actual token outside them gets k + 1, a lower bound
(vLLM counts it exactly). Sorting by rank, as TRL does, gives vLLM's order either way.
"""
from functools import lru_cache

from engine.frontend.outputs import CompletionOutput, RequestOutput

MIN_LOGPROB = -9999.0  # vLLM's clamp for prompt logprobs: JSON has no -inf


def token_id_label(token_id: int) -> str:
    """vLLM's format_token_id_placeholder."""
    return f"token_id:{token_id}"


class TokenText:
    """Token id -> its text (cached: the same ids recur), and the label a request asked for."""

    def __init__(self, tokenizer):
        self.text = lru_cache(maxsize=1 << 16)(lambda t: tokenizer.decode([t]))

    def labeler(self, as_token_ids: bool):
        return token_id_label if as_token_ids else self.text


def _offsets(texts: list[str], start: int) -> list[int]:
    offsets, pos = [], start
    for s in texts:
        offsets.append(pos)
        pos += len(s)
    return offsets


def completion_logprobs(c: CompletionOutput, tokens: TokenText, offset: int, label) -> dict | None:
    """OpenAI's completions logprobs of the generated tokens; `label`: TokenText.labeler(...)."""
    if c.logprobs is None:
        return None
    top = []
    for i, t in enumerate(c.token_ids):
        d = {label(t): c.logprobs[i]}
        if c.top_logprobs is not None:
            d.update({label(k): v for k, v in c.top_logprobs[i].items()})
        top.append(d)
    return {"tokens": [label(t) for t in c.token_ids], "token_logprobs": list(c.logprobs), "top_logprobs": top,
            "text_offset": _offsets([tokens.text(t) for t in c.token_ids], offset)}


def echo_logprobs(out: RequestOutput, tokens: TokenText, label) -> dict:
    """OpenAI's logprobs of the prompt tokens (echo): the first has none (no prefix); each
    top_logprobs entry holds the actual token and the top-k alternatives."""
    ids = out.prompt_token_ids
    top: list[dict | None] = [None]
    for i in range(1, len(ids)):
        d = {label(ids[i]): out.prompt_logprobs[i]}
        if out.prompt_top_logprobs is not None and out.prompt_top_logprobs[i] is not None:
            d.update({label(k): v for k, v in out.prompt_top_logprobs[i].items()})
        top.append(d)
    return {"tokens": [label(t) for t in ids], "token_logprobs": list(out.prompt_logprobs), "top_logprobs": top,
            "text_offset": _offsets([tokens.text(t) for t in ids], 0)}


def chat_logprobs(c: CompletionOutput, label) -> dict | None:
    """OpenAI's chat logprobs: per token its label, logprob, UTF-8 bytes (of the label, as vLLM)
    and the top-k alternatives best first (a list, possibly empty)."""
    if c.logprobs is None:
        return None
    content = []
    for i, t in enumerate(c.token_ids):
        s = label(t)
        top = []
        if c.top_logprobs is not None:
            top = [{"token": label(k), "logprob": v, "bytes": list(label(k).encode())}
                   for k, v in sorted(c.top_logprobs[i].items(), key=lambda kv: -kv[1])]
        content.append({"token": s, "logprob": c.logprobs[i], "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content}


def ranked_prompt_logprobs(out: RequestOutput, position: int) -> list[tuple[int, float, int]]:
    """[(token_id, logprob, rank)] at one prompt position (>= 1): the actual token first, then the
    top-k best first (the actual token once, with its top-k rank when it is among them)."""
    actual = out.prompt_token_ids[position]
    top = (out.prompt_top_logprobs or [None] * (position + 1))[position] or {}
    ranked = sorted(top.items(), key=lambda kv: -kv[1])
    rank_of = {t: r for r, (t, _) in enumerate(ranked, 1)}
    entries = [(actual, out.prompt_logprobs[position], rank_of.get(actual, len(ranked) + 1))]
    return entries + [(t, lp, rank_of[t]) for t, lp in ranked if t != actual]


def vllm_prompt_logprobs(out: RequestOutput, tokens: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a completion choice: null for the first token (no prefix),
    then {"<token id>": {"logprob", "rank", "decoded_token"}} per position, the actual token and
    the top-k (logprobs clamped at -9999.0 as vLLM does)."""
    result: list[dict | None] = [None]
    for i in range(1, len(out.prompt_token_ids)):
        result.append({str(t): {"logprob": max(lp, MIN_LOGPROB), "rank": rank, "decoded_token": tokens.text(t)}
                       for t, lp, rank in ranked_prompt_logprobs(out, i)})
    return result
