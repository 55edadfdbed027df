"""The trainer's handle on a rollout server: `RolloutClient` (blocking) and `AsyncRolloutClient`
(asyncio), both over httpx, one method per endpoint.

    client = RolloutClient("http://127.0.0.1:8000")
    outs = client.generate([[1, 2, 3], "text"], {"temperature": 1.0, "max_tokens": 64, "logprobs": 0})
    client.init_weight_transfer(backend="gloo")        # the trainer joins as rank 0
    client.push_weights(model.named_parameters(), version=step)
    assert client.weights_checksum() == weight_sync.weights_checksum(model.named_parameters(), torch.float32)

Every endpoint is described once, as a `_Call` (method, path, body, how to read the answer, whether
it is idempotent); the two clients differ only in how they run it (`_run`). Weight pushes are
`client.weights` (rollout/client_weights.py: one implementation for both clients; the
push_weights / weight_update / ... methods here delegate to it). With `wandb_run=run` (or
True for the current `wandb.run`) every push logs rollout/push_seconds, push_gb_per_s and
weight_version to the trainer's own W&B run, without advancing its step. Idempotent calls (GET,
/health, is_*, versions) are retried on connection errors; the others never are. A non-2xx answer
raises `RolloutAPIError` with the server's message and the field at fault (`param`); a server
that cannot be reached, `RolloutConnectionError` (rollout/errors.py) naming the URL.

`timeout` (600 s by default, as the openai client) bounds how long any call waits for an answer,
generation included (a stream: the gap between two events); calls that last a whole weight
transfer or a pause in mode "wait" have no read limit. A call past it raises TimeoutError, and
the server aborts the request it left behind.
"""
from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx
from typing_extensions import Self

from rollout.client_weights import DEFAULT_TIMEOUT_S, WeightTransfer, log_push
from rollout.errors import RolloutAPIError, RolloutConnectionError

Prompt = str | Sequence[int]
RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError)
LONG_TIMEOUT = httpx.Timeout(None, connect=10.0)  # calls that block for a whole transfer


def _bounded_wait(seconds: float) -> httpx.Timeout:
    """For a call the server itself bounds to `seconds` (a wait_s, timeout_s or deadline_s): its
    answer may take that long, plus slack for the server to answer after it."""
    return httpx.Timeout(seconds + 30.0, connect=10.0)


@dataclass
class SamplingMasks:
    """The kept set of every generated token (sampling_params "return_sampling_mask"), by column:
    token i was drawn from the num_kept[i] tokens of highest logit (ties: lower id first), all at
    or above min_logprob[i]; kept_logmass[i] = log of their probability mass (logprobs of logits /
    temperature, before truncation; a "processed" logprob + kept_logmass = the untruncated one).
    ids[i]: that set, highest first ("ids", sets of at most 512), else None."""

    num_kept: list[int]
    min_logprob: list[float]
    kept_logmass: list[float]
    ids: list[list[int] | None]

    @classmethod
    def from_json(cls, d: dict | None) -> SamplingMasks | None:
        return None if d is None else cls(d["num_kept"], d["min_logprob"], d["kept_logmass"], d["ids"])


@dataclass
class GenerateOutput:
    """One generated sequence. logprobs[i] / weight_versions[i] belong to token_ids[i]."""

    token_ids: list[int]
    logprobs: list[float] | None
    weight_versions: list[int]
    text: str
    finish_reason: str | None  # "stale": a push left it past sampling_params' max_weight_staleness
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: Any = None
    prompt_token_ids: list[int] = field(default_factory=list)
    request_id: str = ""
    num_cached_tokens: int = 0
    prompt_logprobs: list[float | None] | None = None  # with sampling_params.prompt_logprobs; [0] is None
    lora_versions: list[int] = field(default_factory=list)  # per token, when `model` named a LoRA adapter
    index: int = 0  # the sample's index (n > 1)
    # a conversation sent with prefix_token_ids (generate_chat): where the chat template's own
    # rendering of the covered turns differs from the prefix ({offset, prefix_ids, rendered_ids}),
    # and the template's turn-closing ids put after the prefix (e.g. "\n" after <|im_end|>)
    retokenization_drift: dict | None = None
    closing_token_ids: list[int] = field(default_factory=list)
    sampling_mask: SamplingMasks | None = None  # with sampling_params.return_sampling_mask
    # with sampling_params.return_routed_experts (a mixture-of-experts model): int16 numpy array
    # (len(prompt_token_ids) + len(token_ids) - 1, num_layers, top_k), the experts each layer routed each
    # token to, -1 in dense layers (routing replay); a streamed delta's: its new rows
    routed_experts: Any = None

    @classmethod
    def from_json(cls, result: dict, c: dict) -> GenerateOutput:
        top = c.get("top_logprobs")
        return cls(token_ids=c["token_ids"], logprobs=c.get("logprobs"), weight_versions=c["weight_versions"],
                   text=c["text"], finish_reason=c.get("finish_reason"), stop_reason=c.get("stop_reason"),
                   top_logprobs=None if top is None else [[(int(t), float(lp)) for t, lp in step] for step in top],
                   prompt_token_ids=result.get("prompt_token_ids", []), request_id=result.get("request_id", ""),
                   num_cached_tokens=result.get("num_cached_tokens", 0),
                   prompt_logprobs=result.get("prompt_logprobs"), lora_versions=c.get("lora_versions", []),
                   index=c.get("index", 0), retokenization_drift=result.get("retokenization_drift"),
                   closing_token_ids=result.get("closing_token_ids", []),
                   sampling_mask=SamplingMasks.from_json(c.get("sampling_mask")),
                   routed_experts=decode_routed_experts(c.get("routed_experts")))


def decode_routed_experts(d: dict | None):
    """The server's {"shape", "dtype", "data": base64 of little-endian bytes} as a numpy array."""
    if d is None:
        return None
    import base64

    import numpy as np

    data = bytearray(base64.b64decode(d["data"]))  # (writable: torch.from_numpy takes it as is)
    return np.frombuffer(data, dtype=np.dtype(d["dtype"]).newbyteorder("<")).reshape(d["shape"])


@dataclass
class AbortManifest:
    """/abort_requests with wait: what every aborted request's caller received, one GenerateOutput
    per sample (request_id, index, token_ids, logprobs, weight_versions, finish_reason: "abort",
    or the real one for a request that ended by itself meanwhile). `pending`: aborted requests
    that had not ended within the timeout (no entry); `already_finished`: ids that had ended
    before the abort; `not_found`: ids the server does not know."""

    requests: list[GenerateOutput]
    aborted: int
    pending: list[str] = field(default_factory=list)
    already_finished: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return not self.pending

    @classmethod
    def from_json(cls, body: dict) -> AbortManifest:
        return cls([GenerateOutput.from_json(e, e) for e in body["requests"]], body["aborted"], body["pending"],
                   body["already_finished"], body["not_found"])


@dataclass
class _Call:
    method: str
    path: str
    parse: Callable[[Any], Any] = lambda body: body
    json: Any = None
    params: dict | None = None
    idempotent: bool = False
    admin: bool = False
    timeout: Any = None  # None: the client's default
    raw: bool = False  # parse gets the response text, not JSON


def _prompt_body(prompts) -> tuple[dict, bool]:
    """{"prompt": ...} or {"prompt_token_ids": ...}, and whether a single prompt was given."""
    single = isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int))
    batch = [prompts] if single else list(prompts)
    if all(isinstance(p, str) for p in batch):
        return {"prompt": batch}, single
    if all(isinstance(p, Sequence) and not isinstance(p, str) for p in batch):
        return {"prompt_token_ids": [list(map(int, p)) for p in batch]}, single
    raise ValueError("prompts must be all texts or all token-id lists (send mixed batches as two calls)")


def _outputs(body: dict, n: int) -> list:
    outs = []
    for r in body["results"]:
        seqs = [GenerateOutput.from_json(r, c) for c in r["outputs"]]
        outs.append(seqs if n > 1 else seqs[0])
    return outs


class _Endpoints:
    """One method per endpoint; `_run` executes the call (or returns a coroutine that does)."""

    def _run(self, call: _Call):
        raise NotImplementedError

    # ---- generation -------------------------------------------------------------------------------
    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: dict | None = None,
                 request_id: str | None = None, model: str | None = None):
        """A list with one entry per prompt, in order (also for a single prompt): a GenerateOutput,
        or with n > 1 the list of its n samples. model: a loaded LoRA adapter's name (default: the
        served model)."""
        body, _ = _prompt_body(prompts)
        sp = dict(sampling_params or {})
        body.update(sampling_params=sp, request_id=request_id)
        if model is not None:
            body["model"] = model
        return self._run(_Call("POST", "/generate", lambda b: _outputs(b, sp.get("n", 1)), json=body))

    def generate_chat(self, messages: list[dict], sampling_params: dict | None = None, request_id: str | None = None,
                      chat_template_kwargs: dict | None = None, tools: list[dict] | None = None,
                      prefix_token_ids: Sequence[int] | None = None):
        """One conversation through the model's chat template (what /v1/chat/completions runs),
        with /generate's token-level answer: a GenerateOutput (a list of n when n > 1).
        prefix_token_ids: the exact ids of the conversation up to its last assistant turn (the
        previous prompt_token_ids + token_ids): the prompt is these ids + what the template adds
        for the newer messages, never a re-tokenization of the earlier turns; the output's
        prompt_token_ids start with them, and retokenization_drift says where the template
        would have rendered them differently (None when it would not)."""
        sp = dict(sampling_params or {})
        body = {"messages": messages, "sampling_params": sp, "request_id": request_id,
                "chat_template_kwargs": chat_template_kwargs, "tools": tools}
        if prefix_token_ids is not None:
            body["prefix_token_ids"] = list(prefix_token_ids)
        return self._run(_Call("POST", "/generate", lambda b: _outputs(b, sp.get("n", 1))[0], json=body))

    def compare_logprobs(self, prompt_token_ids: Sequence[int], token_ids: Sequence[int], logprobs: Sequence[float],
                         weight_version: int | Sequence[int] | None = None, temperature: float = 1.0,
                         allow_version_mismatch: bool = False) -> dict:
        """POST /logprobs/compare: the server recomputes the completion `token_ids` after
        `prompt_token_ids` under its live weights and compares with `logprobs` (of logits /
        temperature; e.g. a GenerateOutput's, with its weight_versions). Returns {"weight_version",
        "max_abs_diff", "mean_abs_diff", "max_abs_diff_index", "diffs", "logprobs", ...}; a
        weight_version other than the live one: RolloutAPIError 409 unless allow_version_mismatch."""
        wv = weight_version if weight_version is None or isinstance(weight_version, int) else list(weight_version)
        body = {"prompt_token_ids": list(prompt_token_ids), "token_ids": list(token_ids), "logprobs": list(logprobs),
                "weight_version": wv, "temperature": temperature, "allow_version_mismatch": allow_version_mismatch}
        return self._run(_Call("POST", "/logprobs/compare", json=body))

    # ---- sessions (multi-turn; rollout/api/sessions.py) ------------------------------------------
    def open_session(self, session_id: str | None = None, timeout_s: float | None = None) -> str:
        """A new session's id (`session()` wraps the whole life of one)."""
        return self._run(_Call("POST", "/open_session", lambda b: b["session_id"],
                               json={"session_id": session_id, "timeout_s": timeout_s}))

    def generate_turn(self, session_id: str, prompt: Prompt, sampling_params: dict | None = None):
        """The session's next turn: `prompt` (token ids, or text as is) follows everything so far;
        the answer is that turn's GenerateOutput (its prompt_token_ids: the turn's input)."""
        body, _ = _prompt_body(prompt)
        body = {k: v[0] for k, v in body.items()}
        body.update(sampling_params=dict(sampling_params or {}), session_params={"id": session_id})
        return self._run(_Call("POST", "/generate", lambda b: _outputs(b, 1)[0], json=body))

    def close_session(self, session_id: str) -> dict:
        """{"session_id", "num_tokens", "num_turns"} (+ "ended": why, if it had ended before)."""
        return self._run(_Call("POST", "/close_session", json={"session_id": session_id}))

    def list_sessions(self) -> list[dict]:
        return self._run(_Call("GET", "/sessions", lambda b: b["sessions"], idempotent=True))

    def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None, **fields) -> list[int]:
        """The token ids the server runs for a text (as is) or a conversation (chat template)."""
        body = dict(fields, prompt=prompt, messages=messages)
        return self._run(_Call("POST", "/tokenize", lambda b: b["tokens"], json=body))

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return self._run(_Call("POST", "/detokenize", lambda b: b["prompt"], json={"tokens": list(token_ids)}))

    def completions(self, prompt, **fields):
        return self._run(_Call("POST", "/v1/completions", json=dict(fields, prompt=prompt)))

    def chat_completions(self, messages: list[dict], **fields):
        return self._run(_Call("POST", "/v1/chat/completions", json=dict(fields, messages=messages)))

    def models(self):
        """The served model names (`model_info()` has their folders and context lengths)."""
        return self._run(_Call("GET", "/v1/models", lambda b: [m["id"] for m in b["data"]], idempotent=True))

    def model_info(self) -> list[dict]:
        """/v1/models' entries: id, root (the model folder on the server), max_model_len, ..."""
        return self._run(_Call("GET", "/v1/models", lambda b: b["data"], idempotent=True))

    # ---- info -------------------------------------------------------------------------------------
    def health(self):
        return self._run(_Call("GET", "/health", lambda b: b.get("status") == "ok", idempotent=True))

    def ready(self, min_weight_version: int | None = None, wait_s: float = 0.0) -> dict:
        """GET /ready: {"status": "ready", "weight_version", "replicas": [{"replica", "weight_version",
        "has_weights"}]} once every
        replica holds weights of at least `min_weight_version` (and of the newest version any
        replica holds); the server waits up to `wait_s` for that. Not ready: RolloutAPIError 503
        saying what is missing."""
        params = {"wait_s": wait_s}
        if min_weight_version is not None:
            params["min_weight_version"] = min_weight_version
        return self._run(_Call("GET", "/ready", params=params, idempotent=True,
                               timeout=_bounded_wait(wait_s) if wait_s else None))

    def metrics(self):
        return self._run(_Call("GET", "/metrics", raw=True, idempotent=True))

    def server_info(self):
        return self._run(_Call("GET", "/server_info", idempotent=True))

    def get_world_size(self):
        return self._run(_Call("GET", "/get_world_size", lambda b: b["world_size"], idempotent=True))

    def is_paused(self):
        return self._run(_Call("GET", "/is_paused", lambda b: b["is_paused"], idempotent=True))

    def is_sleeping(self):
        return self._run(_Call("GET", "/is_sleeping", lambda b: b["is_sleeping"], idempotent=True))

    def weight_version(self, lora_name: str | None = None):
        """The model's weight version, or that of the resident LoRA adapter `lora_name`."""
        if lora_name is None:
            return self._run(_Call("GET", "/weights/version", lambda b: b["weight_version"], idempotent=True))
        return self._run(_Call("GET", "/weights/version", lambda b: b["lora_versions"][lora_name], idempotent=True))

    def weights_checksum(self):
        """The engine's weights checksum (compare with weight_sync.weights_checksum on the trainer)."""
        return self._run(_Call("GET", "/weights/checksum", lambda b: b["checksum"], idempotent=True, admin=True,
                               timeout=LONG_TIMEOUT))

    # ---- control ----------------------------------------------------------------------------------
    def pause(self, mode: str = "abort", clear_cache: bool = True, timeout_s: float | None = None,
              recompute_kv: bool = False):
        """{"aborted": n, "kept": n}. `timeout_s`: the server resumes by itself after that long
        unless resumed (so a trainer that dies while paused does not hang the rollouts).
        `recompute_kv` (keep): weights pushed during the pause make the frozen requests
        recompute their KV under the new weights instead of reusing the old weights' KV."""
        params = {"mode": mode, "clear_cache": str(clear_cache).lower(), "recompute_kv": str(recompute_kv).lower()}
        if timeout_s is not None:
            params["timeout_s"] = timeout_s
        return self._run(_Call("POST", "/pause", params=params, admin=True, timeout=LONG_TIMEOUT))

    def resume(self):
        return self._run(_Call("POST", "/resume", admin=True))

    def sleep(self, level: int = 1, mode: str = "abort"):
        return self._run(_Call("POST", "/sleep", params={"level": level, "mode": mode}, admin=True,
                               timeout=LONG_TIMEOUT))

    def wake_up(self, tags: list[str] | None = None):
        return self._run(_Call("POST", "/wake_up", params={"tags": list(tags)} if tags else None, admin=True,
                               timeout=LONG_TIMEOUT))

    def reset_prefix_cache(self):
        return self._run(_Call("POST", "/reset_prefix_cache", admin=True))

    def reset_encoder_cache(self):
        return self._run(_Call("POST", "/reset_encoder_cache", admin=True))

    def load_lora_adapter(self, lora_name: str, lora_path: str, load_inplace: bool = False):
        """Load a PEFT LoRA adapter (a folder on the server's machine); requests then pass
        lora_name as their model (generate(..., model=lora_name))."""
        return self._run(_Call("POST", "/v1/load_lora_adapter", admin=True, raw=True,
                               json={"lora_name": lora_name, "lora_path": lora_path, "load_inplace": load_inplace}))

    def unload_lora_adapter(self, lora_name: str):
        return self._run(_Call("POST", "/v1/unload_lora_adapter", admin=True, raw=True, json={"lora_name": lora_name}))

    def start_profile(self):
        """Start a torch-profiler trace of the engine core(s) (a server run with --profiler-dir)."""
        return self._run(_Call("POST", "/start_profile", admin=True))

    def stop_profile(self):
        """Stop it; returns the trace files written (server-side paths, one per engine-core replica)."""
        return self._run(_Call("POST", "/stop_profile", lambda b: b["traces"], admin=True))

    def abort_requests(self, request_ids: list[str] | None = None, wait: bool = False, timeout_s: float = 60.0,
                       return_prompt_token_ids: bool = False):
        """Abort these requests (all in flight when None; a batch's id aborts its prompts). Returns
        how many were aborted; with `wait`, an AbortManifest once every aborted request has ended
        (at most `timeout_s`): each sample's tokens, logprobs and weight versions, exactly as its
        own caller received them."""
        if not wait:
            return self._run(_Call("POST", "/abort_requests", lambda b: b["aborted"],
                                   json={"request_ids": request_ids}, admin=True))
        body = {"request_ids": request_ids, "wait": True, "timeout_s": timeout_s,
                "return_prompt_token_ids": return_prompt_token_ids}
        return self._run(_Call("POST", "/abort_requests", AbortManifest.from_json, json=body, admin=True,
                               timeout=_bounded_wait(timeout_s)))

    def scale(self, data_parallel_size: int, drain_timeout_s: float = 60.0):
        """Grow or shrink the server's data-parallel replicas; returns {"data_parallel_size",
        "added", "removed"}. Re-run init_weight_transfer afterwards (the world size changed)."""
        return self._run(_Call("POST", "/scale", json={"data_parallel_size": data_parallel_size,
                                                        "drain_timeout_s": drain_timeout_s},
                               admin=True, timeout=LONG_TIMEOUT))

    def collective_rpc(self, method: str, args: Sequence = (), kwargs: dict | None = None,
                       timeout: float | None = None):
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}, "timeout": timeout}
        return self._run(_Call("POST", "/collective_rpc", lambda b: b["results"], json=body, admin=True,
                               timeout=LONG_TIMEOUT))

    def apply_model(self, fn: str | Callable):
        """fn(model) on every worker of the server, one result per worker; `fn` (an import path, or
        a module-level function the server can import) must be registered there (--apply-model-fn)."""
        path = fn if isinstance(fn, str) else f"{fn.__module__}:{fn.__qualname__}"
        return self._run(_Call("POST", "/apply_model", lambda b: b["results"], json={"fn": path}, admin=True,
                               timeout=LONG_TIMEOUT))

    # ---- weights (the four vLLM phases, and ours) ----------------------------------------------------
    def init_weight_transfer_engine(self, init_info: dict):
        return self._run(_Call("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, admin=True,
                               timeout=LONG_TIMEOUT))

    def start_weight_update(self, is_checkpoint_format: bool = True):
        return self._run(_Call("POST", "/start_weight_update", json={"is_checkpoint_format": is_checkpoint_format},
                               admin=True))

    def update_weights(self, update_info: dict | None = None):
        return self._run(_Call("POST", "/update_weights", json={"update_info": update_info or {}}, admin=True,
                               timeout=LONG_TIMEOUT))

    def finish_weight_update(self, weight_version: int | None = None):
        return self._run(_Call("POST", "/finish_weight_update", lambda b: b["weight_version"],
                               json={"weight_version": weight_version}, admin=True))

    def weights_update(self, source: str, idempotency_key: str | None = None, deadline_s: float | None = None,
                       **fields):
        """POST /weights/update: a whole update in one call (the server receives or reads it while
        generating, pauses, swaps, clears caches and resumes; rollout/api/weight_update.py).
        `source` "gloo" / "nccl" (the push a WeightSender sends beside this call: push_weights),
        "disk" (path=), "ipc" (handles=); fields: version, lora_name, pause_mode, recompute_kv, update_info. With an
        idempotency_key, a connection error is retried (the server answers a retry with the first
        call's answer). A failure raises RolloutAPIError with .phase and .weight_version."""
        return self._run(self._weights_update_call(source, idempotency_key, deadline_s, lambda b: b, **fields))

    def weights_update_status(self, idempotency_key: str):
        """GET /weights/update?idempotency_key=: {"status": "done", "result": the answer} or
        {"status": "running"}; RolloutAPIError 404 when the server does not know the key."""
        return self._run(_Call("GET", "/weights/update", params={"idempotency_key": idempotency_key}, admin=True,
                               idempotent=True))

    @staticmethod
    def _weights_update_call(source: str, idempotency_key: str | None, deadline_s: float | None, parse,
                             **fields) -> _Call:
        body = {"source": source, **{k: v for k, v in fields.items() if v is not None}}
        if idempotency_key is not None:
            body["idempotency_key"] = idempotency_key
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        # the server answers within deadline_s (plus its backstop, rollout/api/weight_update.py)
        timeout = LONG_TIMEOUT if deadline_s is None else _bounded_wait(deadline_s)
        return _Call("POST", "/weights/update", parse, json=body, admin=True, timeout=timeout,
                     idempotent=idempotency_key is not None)

    def push_weights_from_disk(self, path: str, version: int | None = None, lora_name: str | None = None,
                               idempotency_key: str | None = None, deadline_s: float | None = None):
        """A safetensors folder on the server's disk, in one POST /weights/update: the server reads
        it while generating, pauses (mode keep: requests in flight freeze and continue on the new
        weights), swaps, clears caches and resumes (a pause the caller made stays). With
        `lora_name`, a PEFT folder: that adapter's new weights under its own version.
        `idempotency_key`, `deadline_s`: see push_weights."""
        return self._run(self._weights_update_call("disk", idempotency_key, deadline_s, self._push_logger("disk"),
                                                   path=str(path), version=version, lora_name=lora_name))

    def update_weights_from_disk(self, path: str, version: int | None = None, lora_name: str | None = None):
        """POST /update_weights_from_disk: the update alone (pause generation first, or run idle)."""
        return self._run(_Call("POST", "/update_weights_from_disk", self._push_logger("disk"),
                               json={"path": str(path), "version": version, "lora_name": lora_name}, admin=True,
                               timeout=LONG_TIMEOUT))

    def reload_weights(self, version: int | None = None):
        """The server's start-up checkpoint again (after sleep level 2, or to undo pushes)."""
        return self._run(_Call("POST", "/reload_weights", self._push_logger("disk"), json={"version": version},
                               admin=True, timeout=LONG_TIMEOUT))

    def update_weights_from_ipc(self, handles: dict, version: int | None = None, lora_name: str | None = None):
        """Tensors shared from this machine (weight_sync.SharedWeights; keep it open until this
        returns). Pause generation first, or run idle: `push_weights_shared` does it all."""
        return self._run(_Call("POST", "/update_weights_from_ipc", self._push_logger("ipc"),
                               json={"handles": handles, "version": version, "lora_name": lora_name}, admin=True,
                               timeout=LONG_TIMEOUT))

    def _push_logger(self, source: str) -> Callable[[dict], dict]:
        """A response parser that logs the push (timed from now) to the trainer's W&B run."""
        t0 = time.perf_counter()

        def logged(body: dict) -> dict:
            log_push(self.wandb_run, source, time.perf_counter() - t0, body.get("num_bytes"),
                     body.get("weight_version"))
            return body

        return logged

    def close_weight_transfer_engine(self):
        return self._run(_Call("POST", "/close_weight_transfer", admin=True))

    def lease_weight_spare(self, holder: str, layouts: list[str] = (), replicas: list[int] | None = None):
        """POST /weights/spare: where the server stages its next update, for this trainer to write
        into (push_weights_shared uses it; `layouts`: the packs its SpareWriter runs; `replicas`:
        only those data-parallel replicas lend theirs; 400 where the server lends none, 409 while
        another trainer holds it)."""
        return self._run(_Call("POST", "/weights/spare", json={"holder": holder, "layouts": list(layouts),
                                                               "replicas": replicas}, admin=True))

    def save_weights(self, path: str, overwrite: bool = False, max_shard_bytes: int | None = None):
        """Write the server's live weights (pushes included) as a Hugging Face folder on its disk,
        which transformers loads; a folder that exists and is not empty is refused unless
        `overwrite`. Returns {"path", "files", "bytes", "tensors", "weight_version"}."""
        return self._run(_Call("POST", "/save_weights", json={"path": str(path), "overwrite": overwrite,
                                                               "max_shard_bytes": max_shard_bytes},
                               admin=True, timeout=LONG_TIMEOUT))

    # ---- the trainer's side of weight pushes (rollout/client_weights.py, `self.weights`) --------
    def init_weight_transfer(self, backend: str = "gloo", master_address: str = "127.0.0.1",
                             master_port: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
                             bucket_bytes: int | None = None, shared_memory_when_local: bool = True):
        """Form the transfer group: this process is rank 0, the server's workers join.
        `shared_memory_when_local`: push_weights to a CPU server on this machine goes through
        shared memory instead (see WeightTransfer.init)."""
        return self.weights.init(backend, master_address, master_port, timeout_s, bucket_bytes,
                                 shared_memory_when_local)

    def push_weights(self, named_tensors, version: int | None = None, pause_mode: str = "keep", dtype=None,
                     recompute_kv: bool = False, lora_name: str | None = None, idempotency_key: str | None = None,
                     deadline_s: float | None = None):
        """broadcast (the server generates meanwhile) -> pause -> atomic swap -> clear caches ->
        resume, in one POST /weights/update beside the broadcast (see WeightTransfer.push;
        `lora_name`: a LoRA adapter's tensors; `idempotency_key`: a retry gets the first push's
        result; `deadline_s`: for all of it)."""
        return self.weights.push(named_tensors, version, pause_mode, dtype, recompute_kv, lora_name,
                                 idempotency_key, deadline_s)

    def weight_update(self, version: int | None = None, pause_mode: str = "keep", dtype=None,
                      recompute_kv: bool = False):
        """One update in several chunks, as a context manager (see WeightTransfer.update)."""
        return self.weights.update(version, pause_mode, dtype, recompute_kv)

    def push_weights_shared(self, named_tensors, version: int | None = None, pause_mode: str = "keep",
                            recompute_kv: bool = False, lora_name: str | None = None, dtype=None,
                            idempotency_key: str | None = None, deadline_s: float | None = None):
        """Same machine: CUDA IPC on a shared GPU, shared memory on CPU; no group needed. Tensors
        are cast to the engine's dtype (or `dtype`), as push_weights does; one POST
        /weights/update {source: ipc} pauses for the swap and resumes."""
        return self.weights.push_shared(named_tensors, version, pause_mode, recompute_kv, lora_name, dtype,
                                        idempotency_key, deadline_s)

    def close_weight_transfer(self):
        return self.weights.close()


class _Transport:
    def __init__(self, url: str, api_key: str | None, admin_api_key: str | None, timeout: float,
                 retries: int):
        self.url = url.rstrip("/")
        self.api_key, self.admin_api_key = api_key, admin_api_key
        self.timeout, self.retries = timeout, retries

    def _request_kwargs(self, call: _Call) -> dict:
        key = self.admin_api_key if call.admin and self.admin_api_key else self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return dict(method=call.method, url=self.url + call.path, json=call.json, params=call.params,
                    headers=headers, timeout=self.timeout if call.timeout is None else call.timeout)

    @contextlib.contextmanager
    def _timeouts(self, call: _Call):
        """httpx's read / write / pool timeouts as the builtin TimeoutError (connection errors,
        connect timeouts included, stay httpx's: the retry logic tells them apart)."""
        try:
            yield
        except (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout) as e:
            raise TimeoutError(f"{call.method} {call.path}: no answer from {self.url} within "
                               f"{self.timeout if call.timeout is None else call.timeout} s") from e

    @contextlib.contextmanager
    def _unreachable(self, call: _Call):
        """A server that cannot be reached (after any retries) as RolloutConnectionError, which
        names the URL, instead of httpx's bare ConnectError."""
        try:
            yield
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise RolloutConnectionError(self.url, call.method, call.path) from e

    @staticmethod
    def _read(call: _Call, resp: httpx.Response):
        if resp.status_code >= 400:
            raise _api_error(resp)
        if call.raw:
            return call.parse(resp.text)
        return call.parse(resp.json() if resp.content else {})


def _api_error(resp: httpx.Response) -> RolloutAPIError:
    try:
        err = resp.json().get("error", {})
        if isinstance(err, str):
            err = {"message": err}
    except (ValueError, AttributeError):
        err = {"message": resp.text[:500]}
    details = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
    return RolloutAPIError(resp.status_code, err.get("message", ""), err.get("type", "error"), err.get("param"),
                           details)


class RolloutClient(_Transport, _Endpoints):
    """Blocking client. Usable as a context manager (closes the weight transfer group and the
    connection pool)."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 admin_api_key: str | None = None, timeout: float | None = 600.0, retries: int = 3,
                 wandb_run: Any = None):
        super().__init__(url, api_key, admin_api_key, timeout, retries)
        self.http = httpx.Client(timeout=timeout)
        self.wandb_run = wandb_run
        self.weights = WeightTransfer(self, is_async=False)

    def _run(self, call: _Call):
        with self._unreachable(call):
            for attempt in range(self.retries + 1 if call.idempotent else 1):
                try:
                    with self._timeouts(call):
                        return self._read(call, self.http.request(**self._request_kwargs(call)))
                except RETRYABLE:
                    if attempt >= (self.retries if call.idempotent else 0):
                        raise
                    time.sleep(min(0.1 * 2 ** attempt, 2.0))

    def generate_stream(self, prompts, sampling_params: dict | None = None, request_id: str | None = None):
        """Yields (prompt index, [GenerateOutput delta per sample: only the new tokens]) as they
        come: always a list, of n deltas (sample i at position i; a sample without new tokens in
        this event has an empty delta)."""
        body, _ = _prompt_body(prompts)
        body.update(sampling_params=dict(sampling_params or {}), request_id=request_id, stream=True)
        call = _Call("POST", "/generate", json=body)
        with self._unreachable(call), self._timeouts(call), self.http.stream(**self._request_kwargs(call)) as resp:
            if resp.status_code >= 400:
                resp.read()
                raise _api_error(resp)
            for line in resp.iter_lines():
                if line:
                    yield _delta(jsonlib.loads(line))

    def session(self, session_id: str | None = None, timeout_s: float | None = None) -> Session:
        """A multi-turn session (a context manager that closes it):

            with client.session() as s:
                out = s.generate(prompt_ids, {"max_tokens": 64, "temperature": 1.0, "logprobs": 0})
                out = s.generate(tool_answer_ids, {"max_tokens": 64})
                s.token_ids, s.generated  # the whole conversation, and which tokens the model wrote
        """
        return Session(self, self.open_session(session_id, timeout_s))

    @contextlib.contextmanager
    def paused(self, mode: str = "abort", clear_cache: bool = True):
        """with client.paused(): ...  (generation resumes on exit, also on error)"""
        self.pause(mode=mode, clear_cache=clear_cache)
        try:
            yield self
        finally:
            self.resume()

    def wait_until_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health():
                    return
            except (httpx.HTTPError, RolloutAPIError, RolloutConnectionError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} not healthy within {timeout} s")
            time.sleep(0.2)

    def close(self) -> None:
        self.close_weight_transfer()
        self.http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRolloutClient(_Transport, _Endpoints):
    """asyncio client: the same methods, awaited."""

    def __init__(self, url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 admin_api_key: str | None = None, timeout: float | None = 600.0, retries: int = 3,
                 wandb_run: Any = None):
        super().__init__(url, api_key, admin_api_key, timeout, retries)
        self.http = httpx.AsyncClient(timeout=timeout)
        self.wandb_run = wandb_run
        self.weights = WeightTransfer(self, is_async=True)

    async def _run(self, call: _Call):
        with self._unreachable(call):
            for attempt in range(self.retries + 1 if call.idempotent else 1):
                try:
                    with self._timeouts(call):
                        return self._read(call, await self.http.request(**self._request_kwargs(call)))
                except RETRYABLE:
                    if attempt >= (self.retries if call.idempotent else 0):
                        raise
                    await asyncio.sleep(min(0.1 * 2 ** attempt, 2.0))

    async def generate_stream(self, prompts, sampling_params: dict | None = None,
                              request_id: str | None = None):
        body, _ = _prompt_body(prompts)
        body.update(sampling_params=dict(sampling_params or {}), request_id=request_id, stream=True)
        call = _Call("POST", "/generate", json=body)
        with self._unreachable(call), self._timeouts(call):
            async for delta in self._stream(call):
                yield delta

    async def _stream(self, call: _Call):
        async with self.http.stream(**self._request_kwargs(call)) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise _api_error(resp)
            async for line in resp.aiter_lines():
                if line:
                    yield _delta(jsonlib.loads(line))

    async def session(self, session_id: str | None = None, timeout_s: float | None = None) -> AsyncSession:
        """`async with await client.session() as s: out = await s.generate(ids, params)`."""
        return AsyncSession(self, await self.open_session(session_id, timeout_s))

    @contextlib.asynccontextmanager
    async def paused(self, mode: str = "abort", clear_cache: bool = True):
        await self.pause(mode=mode, clear_cache=clear_cache)
        try:
            yield self
        finally:
            await self.resume()

    async def aclose(self) -> None:
        await self.close_weight_transfer()
        await self.http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _delta(event: dict):
    if "error" in event:
        e = event["error"]
        raise RolloutAPIError(e.get("code", 500), e.get("message", ""), e.get("type", "error"), e.get("param"))
    return event["prompt_index"], [GenerateOutput.from_json(event, c) for c in event["outputs"]]


class _SessionRecord:
    """A session's conversation as the client saw it: every token in order, which ones the model
    generated, and their logprobs and weight versions (None / -1 for input tokens)."""

    def __init__(self, client, session_id: str):
        self.client, self.id = client, session_id
        self.token_ids: list[int] = []
        self.generated: list[bool] = []
        self.logprobs: list[float | None] = []
        self.weight_versions: list[int] = []
        self.outputs: list[GenerateOutput] = []
        self.closed = False

    def _request(self, prompt, sampling_params):
        if self.closed:
            raise RuntimeError(f"session {self.id!r} is closed")
        return self.client.generate_turn(self.id, prompt, sampling_params)

    def _record(self, out: GenerateOutput) -> GenerateOutput:
        n_in, n_out = len(out.prompt_token_ids), len(out.token_ids)
        self.token_ids += out.prompt_token_ids + out.token_ids
        self.generated += [False] * n_in + [True] * n_out
        self.logprobs += [None] * n_in + (list(out.logprobs) if out.logprobs is not None else [None] * n_out)
        self.weight_versions += [-1] * n_in + list(out.weight_versions)
        self.outputs.append(out)
        return out


class Session(_SessionRecord):
    """RolloutClient.session(): see there."""

    def generate(self, prompt: Prompt, sampling_params: dict | None = None) -> GenerateOutput:
        return self._record(self._request(prompt, sampling_params))

    def close(self) -> dict | None:
        if self.closed:
            return None
        self.closed = True
        try:
            return self.client.close_session(self.id)
        except RolloutAPIError as e:
            if e.status == 404:  # timed out or closed by the server already
                return None
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncSession(_SessionRecord):
    """AsyncRolloutClient.session(): the same, awaited."""

    async def generate(self, prompt: Prompt, sampling_params: dict | None = None) -> GenerateOutput:
        return self._record(await self._request(prompt, sampling_params))

    async def close(self) -> dict | None:
        if self.closed:
            return None
        self.closed = True
        try:
            return await self.client.close_session(self.id)
        except RolloutAPIError as e:
            if e.status == 404:
                return None
            raise

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
