"""/abort_requests with `wait: true`: abort, then answer with a manifest of what every aborted
request's caller received (its tokens, logprobs, weight versions, finish reason), once each one
has ended. A trainer gets its partial rollouts from one call instead of aborting, polling until
the server is idle and collecting the partial answers from its own pending requests (slime's loop).

Every generation the server runs goes through ServerState.generate (and session turns through
Sessions.turn), which keeps a `RequestRecord` per request in flight: the outputs its caller got,
merged into one cumulative RequestOutput. The manifest is built from those records, so it is by
construction what the caller received; a request's record ends when its final output passed to
its caller (or its caller went away). Requests that had already ended before the abort landed
are listed by id in `already_finished` (the server keeps the ids of the last few thousand);
ids neither in flight nor recently ended are `not_found`.

With several API servers (--api-server-count), a request lives in the API server that took it:
an /abort_requests reaches the requests of the API server that answers it only. Data-parallel
replicas behind one API server are all covered (the API server's frontend owns every request and
routes each abort to its replica).
"""
import asyncio
import collections
import dataclasses

from engine.frontend.async_llm import merge_delta
from engine.frontend.outputs import RequestOutput
from rollout.api.output_json import completion_json

MAX_RECENTLY_ENDED = 4096  # ids of ended requests kept to tell "already finished" from "not found"


class RequestRecord:
    """What one request's caller has received so far, as one cumulative RequestOutput (DELTA
    outputs merged into a copy: the caller's own objects are never touched)."""

    __slots__ = ("delta", "ended", "error", "n", "output", "request_id")

    def __init__(self, request_id: str, delta: bool, n: int):
        self.request_id, self.delta, self.n = request_id, delta, n
        self.output: RequestOutput | None = None
        self.ended = asyncio.Event()
        self.error: str | None = None

    def see(self, out: RequestOutput) -> None:
        if not self.delta:  # cumulative and final-only outputs are whole snapshots already
            self.output = out
        elif self.output is None:
            self.output = _copy(out)
        else:
            merge_delta(self.output, out)

    def entries(self, prompt_token_ids: bool) -> list[dict]:
        """One manifest entry per sample (n > 1: each child, by `index`). A sample that never got
        a final output (its caller went away, or the request failed) reads finish_reason "abort"."""
        out = self.output
        completions = [completion_json(c) for c in out.outputs] if out is not None else [
            {"index": i, "text": "", "token_ids": [], "logprobs": None, "weight_versions": [],
             "finish_reason": None, "stop_reason": None} for i in range(self.n)]
        entries = []
        for c in completions:
            entry = {"request_id": self.request_id, **c}
            if entry["finish_reason"] is None:
                entry["finish_reason"] = "abort"
            if prompt_token_ids and out is not None:
                entry["prompt_token_ids"] = out.prompt_token_ids
            if out is not None:
                entry["num_cached_tokens"] = out.num_cached_tokens
            if self.error is not None:
                entry["error"] = self.error
            entries.append(entry)
        return entries


def _copy(out: RequestOutput) -> RequestOutput:
    outputs = [dataclasses.replace(c, token_ids=list(c.token_ids), weight_versions=list(c.weight_versions),
                                   lora_versions=list(c.lora_versions),
                                   logprobs=None if c.logprobs is None else list(c.logprobs),
                                   top_logprobs=None if c.top_logprobs is None else list(c.top_logprobs))
               for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)


class RecentlyEnded:
    """The ids of the last MAX_RECENTLY_ENDED requests that ended (no outputs: their callers have them)."""

    def __init__(self, size: int = MAX_RECENTLY_ENDED):
        self.ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.size = size

    def add(self, request_id: str) -> None:
        self.ids[request_id] = None
        self.ids.move_to_end(request_id)
        if len(self.ids) > self.size:
            self.ids.popitem(last=False)

    def matching(self, wanted: list[str]) -> set[str]:
        """The wanted ids that name an ended request, or an ended batch's prompts ("<id>-<i>")."""
        return {w for w in wanted if w in self.ids or any(rid.startswith(w + "-") for rid in self.ids)}


def expand_ids(in_flight, wanted: list[str]) -> tuple[list[str], set[str]]:
    """(the in-flight request ids `wanted` names, the wanted ids that named none): an id names
    its own request and a batch's prompts ("<id>-<i>")."""
    ids: dict[str, None] = {}  # (ordered, without repeats)
    matched = set()
    for want in wanted:
        for rid in list(in_flight):
            if rid == want or rid.startswith(want + "-"):
                ids[rid] = None
                matched.add(want)
    return list(ids), set(wanted) - matched


async def abort_with_manifest(state, wanted: list[str] | None, timeout_s: float, prompt_token_ids: bool) -> dict:
    """Abort the requests `wanted` names (every one in flight when None), wait until each has
    ended (at most `timeout_s`), and answer with what their callers received."""
    if wanted is None:
        ids, unmatched = list(state.in_flight), set()
    else:
        ids, unmatched = expand_ids(state.in_flight, wanted)
    records = [state.records[rid] for rid in ids if rid in state.records]
    if ids:
        await state.engine.abort(ids)
    if records:
        waits = [asyncio.ensure_future(r.ended.wait()) for r in records]
        _, pending = await asyncio.wait(waits, timeout=timeout_s)
        for w in pending:
            w.cancel()
    done = [r for r in records if r.ended.is_set()]
    finished = state.recently_ended.matching(sorted(unmatched))
    answer = {"status": "aborted" if len(done) == len(records) else "timed_out", "aborted": len(ids),
              "requests": [e for r in done for e in r.entries(prompt_token_ids)],
              "pending": [r.request_id for r in records if not r.ended.is_set()],
              "already_finished": [w for w in wanted or [] if w in finished],
              "not_found": [w for w in wanted or [] if w in unmatched and w not in finished]}
    if answer["pending"]:
        answer["message"] = (f"{len(answer['pending'])} aborted request(s) had not handed their final output to "
                             f"their caller within timeout_s={timeout_s:g} (a streaming client that stopped "
                             f"reading?): they are aborted, their entries are missing")
    return answer
