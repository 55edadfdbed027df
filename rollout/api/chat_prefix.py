"""Chat with the earlier turns as token ids (`prefix_token_ids` on /generate's `messages` and on
/v1/chat/completions): token in, token out across turns, with drift reported instead of hidden.

A multi-turn rollout sends the whole conversation as `messages` and, as `prefix_token_ids`, the
exact ids of it up to and including its last assistant turn as generated (the previous prompt ids
+ completion ids). The prompt run is

    prefix_token_ids + closing + the ids the chat template adds for the newer messages
                                 (through the generation prompt)

and never a re-tokenization of the earlier turns: the answer's prompt_token_ids begin with the
prefix, whatever the template would have made of those turns.

- closing: a model stops on its end-of-turn token (<|im_end|> for ChatML), but the template closes
  the turn with more ("<|im_end|>\\n"); those ids cannot be sampled, so they are put after the
  prefix (`closing_token_ids` in the answer; the end-of-turn token too when the turn was cut by
  max_tokens or a stop string). They follow the template's own ids for that turn's ending, and
  are not drift: a prefix that already holds them gets nothing appended.
- drift: the template's ids for the covered messages (rendered alone, no generation prompt) are
  compared with prefix + closing; the first offset where they differ (or where one ends) is
  `retokenization_drift: {offset, prefix_ids, rendered_ids, window_start, prefix_tokens,
  rendered_tokens}` (a few ids around it from each, starting at window_start), null when they
  agree. Typical causes: the model spelled a word with other tokens than the tokenizer would
  ("C"+"ALL" vs "CALL"), text the template normalizes (whitespace), a prefix that covers fewer or
  more turns than `messages` up to its last assistant message. The prompt runs anyway: offsets
  are positions in prompt_token_ids.
- The new messages' ids are the template's ids for the whole conversation past the covered
  turns' ids, where the whole rendering's ids start with them (no token straddles the seam; true of
  every template with special tokens between turns), else the seam's text tokenized alone.
- A template that rewrites earlier turns once later messages follow (Qwen3 drops the reasoning of
  old turns) has no ids "added for the new messages": refused with a 400 naming `messages`.

vLLM's /v1/chat/completions re-renders every turn from text (`return_token_ids` only reports the
ids); SkyRL keeps ids client-side by rendering new observations after a fixed base conversation;
this does it server-side with the real conversation and says where the ids disagree.
"""
from dataclasses import dataclass

from rollout.api.chat_render import off_loop, render_chat
from rollout.api.errors import APIError

DRIFT_WINDOW = 2  # ids shown before the drift offset (and 3 from it on)


@dataclass
class PrefixedPrompt:
    token_ids: list[int]  # what runs: prefix + closing + the new messages' ids
    closing_token_ids: list[int]
    drift: dict | None

    def answer_fields(self) -> dict:
        return {"retokenization_drift": self.drift, "closing_token_ids": self.closing_token_ids}


def check_prefix(state, prefix: list[int], field: str = "prefix_token_ids") -> None:
    """400s naming the field for a prefix that cannot run: empty, ids outside the vocabulary,
    or no room left in the context."""
    if not prefix:
        raise APIError(400, f"{field} is empty", field)
    vocab = state.engine.processor.vocab_size
    bad = next((i for i, t in enumerate(prefix) if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{field}[{bad}] = {prefix[bad]} is out of the vocabulary [0, {vocab})", f"{field}[{bad}]")
    limit = state.engine.max_model_len
    if len(prefix) >= limit:
        raise APIError(400, f"{field} holds {len(prefix)} tokens, but the context holds {limit} (max_model_len) "
                            f"including the new messages and the answer", field)


async def prefixed_prompt(state, messages: list, prefix: list[int], add_generation_prompt: bool = True,
                          chat_template_kwargs: dict | None = None, tools: list | None = None) -> PrefixedPrompt:
    check_prefix(state, prefix)
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=None)
    if last is None:
        raise APIError(400, "prefix_token_ids covers the conversation up to its last assistant message, but "
                            "messages has no assistant message", "prefix_token_ids")

    async def render(msgs, gen_prompt: bool) -> str:
        text = await render_chat(state, msgs, gen_prompt, chat_template_kwargs=chat_template_kwargs, tools=tools)
        if isinstance(text, dict):
            raise APIError(400, "prefix_token_ids: conversations with images are not supported", "messages")
        return text

    covered_text = await render(messages[:last + 1], False)
    full_text = await render(messages, add_generation_prompt)
    if not full_text.startswith(covered_text):
        raise APIError(400, "the chat template renders the turns up to the last assistant message differently once "
                            "later messages follow (it rewrites earlier turns, e.g. drops their reasoning): there are "
                            "no ids it adds for the new messages alone; send the conversation without "
                            "prefix_token_ids", "messages")
    # where the last assistant turn's own ids start: its ending is looked for from there on
    opened_text = await render(messages[:last], True) if last else ""
    tokenize = state.engine.tokenizer.encode

    def ids(text: str) -> list[int]:
        return tokenize(text, add_special_tokens=False) if text else []

    covered = await off_loop(ids, covered_text, size=len(covered_text))
    full = await off_loop(ids, full_text, size=len(full_text))
    opened = ids(opened_text) if covered_text.startswith(opened_text) else []
    start = len(opened) if covered[:len(opened)] == opened else 0
    new = full[len(covered):] if full[:len(covered)] == covered else ids(full_text[len(covered_text):])
    closing = turn_closing(prefix, covered, start, end_of_turn_ids(state))
    have = prefix + closing
    limit = state.engine.max_model_len
    if len(have) + len(new) >= limit:
        raise APIError(400, f"prefix_token_ids ({len(prefix)} tokens) + the turn's closing ({len(closing)}) + the new "
                            f"messages ({len(new)}) make {len(have) + len(new)} tokens, but the context holds {limit} "
                            f"(max_model_len), leaving no room to generate", "prefix_token_ids")
    return PrefixedPrompt(have + new, closing, drift(have, covered, state.engine.tokenizer))


def end_of_turn_ids(state) -> set[int]:
    """The ids a turn of the model ends on (what the engine stops at)."""
    cfg = getattr(getattr(state.engine, "config", None), "model_config", None)
    eos = set(getattr(cfg, "eos_token_ids", None) or [])
    eos.add(state.engine.processor.eos_token_id)
    return {t for t in eos if t is not None}


def turn_closing(prefix: list[int], covered: list[int], start: int, eos: set[int]) -> list[int]:
    """The template's ids that close the last assistant turn and that the prefix lacks: its ending
    is `covered` from the turn's last end-of-turn token (searched from `start`, where the turn's
    own ids begin) on; the prefix may already end with any start of it."""
    e = next((i for i in range(len(covered) - 1, start - 1, -1) if covered[i] in eos), None)
    if e is None:
        return []
    ending = covered[e:]
    for k in range(len(ending), 0, -1):
        if prefix[-k:] == ending[:k]:
            return ending[k:]
    return ending


def drift(have: list[int], rendered: list[int], tokenizer=None) -> dict | None:
    """Where `have` (prefix + closing) first differs from the template's ids, or None."""
    n = min(len(have), len(rendered))
    offset = next((i for i in range(n) if have[i] != rendered[i]), n)
    if offset == len(have) == len(rendered):
        return None
    lo = max(0, offset - DRIFT_WINDOW)
    out = {"offset": offset, "window_start": lo, "prefix_ids": have[lo:offset + 3],
           "rendered_ids": rendered[lo:offset + 3]}
    if tokenizer is not None:  # what the ids spell, to read the drift without a tokenizer at hand
        out["prefix_tokens"] = tokenizer.convert_ids_to_tokens(out["prefix_ids"])
        out["rendered_tokens"] = tokenizer.convert_ids_to_tokens(out["rendered_ids"])
    return out
