"""The control plane: every call a frontend may make on an engine core, declared in one table.

    UTILITIES[name] = Utility(arguments, combine)

`name` is the EngineCore method that serves it (and the AsyncLLM / LLM method that calls it),
`arguments` a Struct whose fields are that method's parameters: a call's positional and keyword
arguments are bound to it and type-checked where the call arrives (the engine-core process, or
the core in process), before the method runs, so a malformed call is an InvalidRequestError
naming the field. `combine` turns the live replicas' answers into one; a verb marked
`first_replica_only` goes to the first live replica alone (one replica's answer is the answer:
saving the weights writes one folder, not one per replica). Nothing outside the table is
reachable from the wire; a new verb is one entry here and its EngineCore method.

The weight update is the one call made of several (`weight_update_plan`: stage everywhere,
then commit everywhere or discard everywhere; an `UpdateTrace` follows its phases).
"""
import re
import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from engine.core.engine_core import stale_version
from engine.errors import EngineStateError, InvalidRequestError
from engine.worker.hf_export import DEFAULT_MAX_SHARD_BYTES


class _Args(msgspec.Struct, forbid_unknown_fields=True):
    pass


class NoArgs(_Args):
    pass


class PauseArgs(_Args):
    mode: str = "abort"  # "abort" | "wait" | "keep" (EngineCore.pause_generation checks it)
    clear_cache: bool = True
    timeout_s: float | None = None
    recompute_kv: bool = False
    unless_paused: bool = False


class SleepArgs(_Args):
    level: int = 1
    mode: str = "abort"


class WakeUpArgs(_Args):
    tags: list[str] | None = None


class InitTransferArgs(_Args):
    master_address: str
    master_port: int
    world_size: int
    backend: str = "gloo"
    timeout_s: float = 60.0
    replica_ranks: list[int] | None = None
    rank_offset: int = 1
    group_name: str | None = None


class StageArgs(_Args):
    source: str  # "broadcast" | "named" | "disk" | "tensors" | "ipc" | "reload" | "peer"
    args: list[Any]  # the source's own (a path, named tensors, IPC handles, a peer's address)
    lora_id: int = 0
    deadline_s: float | None = None
    update_id: str | None = None  # (weight_update_plan's: its commit and discard name it again)


class DiscardArgs(_Args):
    update_id: str | None = None


class LeaseArgs(_Args):
    holder: str
    layouts: list[str] | None = None  # the pack functions the trainer can run (weight_sync.SpareWriter.layouts)
    replicas: list[int] | None = None  # only these replicas lend theirs (None: every one)


class CommitArgs(_Args):
    version: int
    lora_id: int = 0
    lora_path: str | None = None
    update_id: str | None = None


class PeersArgs(_Args):
    master_address: str
    master_port: int
    world_size: int


class LoRAIdArgs(_Args):
    lora_id: int


class WeightVersionArgs(_Args):
    lora_id: int = 0  # 0: the base weights


class VersionArgs(_Args):
    version: Any  # an int; EngineCore.set_weight_version refuses others with its own message
    above: int | None = None


class AddLoRAArgs(_Args):
    lora_name: str
    lora_int_id: Any  # an int >= 1; EngineCore.add_lora refuses others with its own message
    lora_path: str


class ImportLoRAsArgs(_Args):
    loras: list[dict[str, Any]]


class RPCArgs(_Args):
    method: str
    args: list[Any] | None = None
    kwargs: dict[str, Any] | None = None


class SaveWeightsArgs(_Args):
    folder: str
    overwrite: bool = False
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES


class SaveShardedStateArgs(_Args):
    path: str
    pattern: str | None = None
    max_size: int | None = None


class ApplyModelArgs(_Args):
    fn: str  # an import path ("package.module:function"): code never travels


# ---- how the live replicas' answers become one ----------------------------------------------------
def first(results: list) -> Any:
    return results[0]


def any_of(results: list) -> bool:
    return any(results)


def concat(results: list[list]) -> list:
    """One entry per worker (or per replica), in replica order."""
    return [r for rs in results for r in rs]


def agree(results: list) -> Any:
    """The one answer every replica gives; EngineStateError when they differ."""
    if len(set(results)) > 1:
        raise EngineStateError(str(results))
    return results[0]


def per_replica(results: list) -> Any:
    """One replica's answer as it is; several as {"replicas": [their answers]} (each lends its own
    weight spare), without those that gave None (not asked to lend)."""
    return results[0] if len(results) == 1 else {"replicas": [r for r in results if r is not None]}


def combine_checksum(results: list) -> str:
    """weights_checksum: the one every replica gives, or under expert parallelism the checksum of
    the replicas' tensors put together (each holds some experts: weight_sync.checksum)."""
    if not all(isinstance(r, dict) for r in results):
        return agree(results)
    from weight_sync.checksum import combine_digests

    entries = {}
    for r in results:
        entries.update((name, tuple(entry)) for name, entry in r["entries"].items())
    return combine_digests(entries)


def combine_pause(results: list[dict]) -> dict:
    merged = dict(results[0], aborted=sum(r["aborted"] for r in results), kept=sum(r["kept"] for r in results))
    if "was_paused" in merged:  # (asked with unless_paused) paused before only if every replica was
        merged["was_paused"] = all(r["was_paused"] for r in results)
    return merged


def combine_resume(results: list[dict]) -> dict:
    """resume_generation and wake_up: the longest pause one of them ended; asleep if any is."""
    seconds = [r["paused_seconds"] for r in results if r.get("paused_seconds") is not None]
    merged = dict(results[0], paused_seconds=max(seconds) if seconds else None)
    if "is_sleeping" in merged:
        merged["is_sleeping"] = any(r["is_sleeping"] for r in results)
    return merged


_SUMMED_STATS = ("num_running", "num_waiting", "num_preemptions", "num_prefill_tokens", "num_generated_tokens",
                 "num_free_blocks", "num_blocks", "peak_rss_mb", "encoder_cache_hits", "encoder_cache_queries",
                 "num_stale_finished", "num_stale_restarted")


def combine_stats(stats: list[dict]) -> dict:
    """Totals over the replicas, and each replica's own stats under "replicas"."""
    out = dict(stats[0], num_replicas_alive=len(stats), replicas=stats)
    if len(stats) == 1:
        return out
    for k in _SUMMED_STATS:
        if k in out:  # (the encoder cache's only with a vision-language model)
            out[k] = sum(s[k] for s in stats)
    out["kv_usage"] = 1.0 - out["num_free_blocks"] / max(out["num_blocks"], 1)
    out["prefix_hit_rate"] = sum(s["prefix_hit_rate"] for s in stats) / len(stats)
    out["weight_version"] = max(s["weight_version"] for s in stats)
    out["is_paused"] = any(s["is_paused"] for s in stats)
    out["is_sleeping"] = any(s["is_sleeping"] for s in stats)
    out["paused_seconds"] = max(s["paused_seconds"] for s in stats)
    return out


class Utility(NamedTuple):
    arguments: type[_Args]
    combine: Callable[[list], Any] = first
    first_replica_only: bool = False


UTILITIES: dict[str, Utility] = {
    # pause / resume, sleep / wake
    "pause_generation": Utility(PauseArgs, combine_pause),
    "resume_generation": Utility(NoArgs, combine_resume),
    "is_paused": Utility(NoArgs, any_of),
    "sleep": Utility(SleepArgs),
    "wake_up": Utility(WakeUpArgs, combine_resume),
    "is_sleeping": Utility(NoArgs, any_of),
    # weights: the trainer's group, the two phases of an update, versions
    "init_weight_transfer": Utility(InitTransferArgs, concat),
    "close_weight_transfer": Utility(NoArgs),
    "stage_weights": Utility(StageArgs),
    "commit_weights": Utility(CommitArgs),
    "discard_weights": Utility(DiscardArgs),
    "lease_weight_spare": Utility(LeaseArgs, per_replica),
    "send_weights_to_peers": Utility(PeersArgs),
    "weights_checksum": Utility(NoArgs, combine_checksum),
    "save_weights": Utility(SaveWeightsArgs, first, first_replica_only=True),
    "save_sharded_state": Utility(SaveShardedStateArgs, first, first_replica_only=True),
    "get_weight_version": Utility(WeightVersionArgs, agree),
    "set_weight_version": Utility(VersionArgs),
    # caches and stats
    "reset_prefix_cache": Utility(NoArgs),
    "reset_encoder_cache": Utility(NoArgs),
    "reset_mm_cache": Utility(NoArgs),
    "get_stats": Utility(NoArgs, combine_stats),
    # LoRA adapters
    "add_lora": Utility(AddLoRAArgs),
    "remove_lora": Utility(LoRAIdArgs),
    "pin_lora": Utility(LoRAIdArgs),
    "list_loras": Utility(NoArgs),
    "export_loras": Utility(NoArgs),
    "import_loras": Utility(ImportLoRAsArgs),
    # profiling, and the workers
    "start_profile": Utility(NoArgs),
    "stop_profile": Utility(NoArgs, concat),
    "collective_rpc": Utility(RPCArgs, concat),
    "apply_model": Utility(ApplyModelArgs, concat),
}


def group_replicas(live: list[int], replicas: list[int] | None) -> list[int]:
    """The live replicas (data_parallel_ranks) whose workers join a weight transfer group:
    `replicas` (a trainer on the machine of the others pushes to those through shared memory),
    in the live order, or every live one."""
    if replicas is None:
        return live
    unknown = sorted(set(replicas) - set(live))
    if unknown or not replicas:
        raise InvalidRequestError(f"replicas must name live replicas ({live}), got {list(replicas)}", "replicas")
    return [r for r in live if r in replicas]


def replicas_for(method: str, live: list) -> list:
    """The live replicas a call goes to: all, or the first for a first_replica_only verb."""
    utility = UTILITIES.get(method) if isinstance(method, str) else None
    return live[:1] if utility is not None and utility.first_replica_only else live


def bind(method: str, args: list | tuple, kwargs: dict) -> dict:
    """The call's arguments by name, type-checked against its table entry; InvalidRequestError
    (naming the field) for an unknown verb or malformed arguments."""
    utility = UTILITIES.get(method) if isinstance(method, str) else None
    if utility is None:
        raise InvalidRequestError(f"the engine core has no method {method!r} (no utility call of that name)", "method")
    fields = utility.arguments.__struct_fields__
    if len(args) > len(fields):
        raise InvalidRequestError(f"{method} takes at most {len(fields)} arguments ({', '.join(fields)}), "
                                  f"got {len(args)}", "method")
    named = dict(zip(fields, args))
    twice = sorted(set(named) & set(kwargs))
    if twice:
        raise InvalidRequestError(f"{method} got {twice[0]!r} twice", twice[0])
    try:
        bound = msgspec.convert({**named, **kwargs}, utility.arguments)
    except msgspec.ValidationError as e:
        field = re.search(r"`\$\.(\w+)`|field `(\w+)`", str(e))
        raise InvalidRequestError(f"{method}: {e}", next(filter(None, field.groups())) if field else None) from None
    return {f: getattr(bound, f) for f in fields}


def combine(method: str, results: list) -> Any:
    """One answer from every live replica's answer to a utility call."""
    if len(results) == 1 and method != "get_stats":
        return results[0]
    try:
        return UTILITIES[method].combine(results)
    except EngineStateError as e:  # (agree)
        raise EngineStateError(f"the data-parallel replicas disagree on {method}: {e}") from None


@dataclass
class UpdateTrace:
    """Where one weight update is: `phase` is the phase running, or the one that failed once the
    update raised; `seconds` what each finished phase took. Phases: "receive" (every replica
    stages: the bytes arrive or are read into fresh tensors), "stage" (the verdict: every replica
    accepted them, the version increases, the deadline holds; otherwise everything staged is
    discarded), "pause" (when the update pauses generation itself: see weight_update_plan),
    "swap" (the copy into the live weights, the new version), "clear_cache" (prefix and encoder
    caches, in the same engine call as the swap). A refusal of what was sent (names, shapes,
    dtypes, a bad checkpoint) fails "stage"; a transport failure or a deadline while receiving
    fails "receive". `paused`: the answer of the update's own pause once it was asked for (a
    pause that failed or ran out of time counts as made here: the caller resumes it).
    `update_id`: what the update's stage, commit and discard calls name it by, so that an update
    another frontend staged meanwhile is neither made live nor dropped in this one's name."""

    phase: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    paused: dict | None = None
    update_id: str = field(default_factory=lambda: secrets.token_hex(8))

    @property
    def paused_here(self) -> bool:
        """The update's own pause is in place: the caller lifts it (also after a failure)."""
        return self.paused is not None and not self.paused["was_paused"]


def _refused(e: BaseException) -> bool:
    """Bad input (what the trainer sent, a path), as opposed to a transport failure or a timeout."""
    from weight_sync.group import WeightPushRefused

    return isinstance(e, (ValueError, TypeError, KeyError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                          WeightPushRefused))


def weight_update_plan(source: str, args: list, version: int | None, lora_id: int = 0,
                       deadline_s: float | None = None, trace: UpdateTrace | None = None,
                       pause: dict | None = None, pause_first: bool = True) -> Generator:
    """Stage the update on every replica; if one refuses, discard it everywhere and raise that
    refusal; else make it live everywhere under one version (default: the newest + 1). Versions
    increase strictly, so a token's version names one set of weights: a version at or below the
    live one is refused (409) after staging, so that a trainer's sender never blocks on a
    receiver that walked away. `lora_id`: an update of that LoRA adapter (its own versions).
    `deadline_s`: staging gives up that many seconds from now (TimeoutError), and an update
    staged past it is discarded rather than made live. `trace`: filled with the phases.
    `pause`: pause_generation's arguments (mode, recompute_kv): the update pauses generation
    unless it is paused already, before staging (`pause_first`) or, where the engine stages
    beside its steps (EngineConfig.stages_weights_beside_steps), only once every replica staged,
    for the swap; its answer is the result's "paused" (and trace.paused). The caller resumes.
    Yields (how, method, kwargs): "each" wants every replica's answer or exception, "all" the
    combined answer."""
    trace = trace if trace is not None else UpdateTrace()
    deadline = None if deadline_s is None else time.monotonic() + deadline_s
    stage = {"source": source, "args": args, "lora_id": lora_id, "update_id": trace.update_id}
    discard = ("each", "discard_weights", {"update_id": trace.update_id})
    if deadline_s is not None:
        stage["deadline_s"] = deadline_s
    if pause is not None and pause_first:
        yield from _pause_plan(pause, deadline, trace)
        if deadline is not None:
            stage["deadline_s"] = deadline - time.monotonic()
    trace.phase, t0 = "receive", time.monotonic()
    staged = yield ("each", "stage_weights", stage)
    trace.seconds["receive"] = time.monotonic() - t0
    trace.phase, t0 = "stage", time.monotonic()
    failures = [r for r in staged if isinstance(r, BaseException)]
    lost = [e for e in failures if not _refused(e)]
    if lost:  # the transport's failure (or the deadline) is the one to report, not a refusal beside it
        trace.phase, failures = "receive", lost
    if not failures and version is not None:
        refusal = stale_version(version, max(s["weight_version"] for s in staged))
        failures = [refusal] if refusal else []
    if not failures and deadline is not None and time.monotonic() >= deadline:
        failures = [TimeoutError(f"the weight update's deadline ({deadline_s:g} s) passed once it was staged: "
                                 "discarded, the old weights stay live")]
    if failures:
        yield discard
        raise failures[0]
    if version is None:
        version = max(s["weight_version"] for s in staged) + 1
    trace.seconds["stage"] = time.monotonic() - t0
    if pause is not None and not pause_first:
        try:
            yield from _pause_plan(pause, deadline, trace)
        except Exception:  # (not GeneratorExit: a plan dropped mid-way yields nothing more)
            yield discard
            raise
    trace.phase, t0 = "swap", time.monotonic()
    answers = yield ("each", "commit_weights", {"version": version, "lora_id": lora_id,
                                                "lora_path": staged[0].get("lora_path"), "update_id": trace.update_id})
    failures = [a for a in answers if isinstance(a, BaseException)]
    if failures:  # (refused: the engine fell asleep, or generation was resumed, since it was staged)
        yield discard
        if len(failures) < len(answers):  # only where another frontend's sleep or resume raced this update
            raise EngineStateError(f"the weight update went live on {len(answers) - len(failures)} of "
                                   f"{len(answers)} replicas, the others refused it: {failures[0]}")
        raise failures[0]
    committed = answers[0]
    trace.seconds["swap"] = time.monotonic() - t0 - committed["clear_cache_s"]
    trace.seconds["clear_cache"] = committed["clear_cache_s"]
    trace.phase = "done"
    return dict(staged[0], weight_version=version, **({"paused": trace.paused} if pause is not None else {}))


def _pause_plan(pause: dict, deadline: float | None, trace: UpdateTrace) -> Generator:
    """An update's own pause (unless one is in place), within what is left of the deadline (a
    "wait" pause waits for the running requests)."""
    trace.phase, t0 = "pause", time.monotonic()
    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
    answers = yield ("each", "pause_generation", dict(pause, clear_cache=False, unless_paused=True, timeout=left))
    failures = [a for a in answers if isinstance(a, BaseException)]
    if failures:  # (a pause that did not answer in time is in place, held by this update)
        trace.paused = {"aborted": 0, "kept": 0, "mode": pause.get("mode"), "was_paused": False}
        error = failures[0]
        if isinstance(error, TimeoutError) and deadline is not None:
            error = TimeoutError(f"the weight update's deadline passed while pausing generation (mode "
                                 f"{pause.get('mode')!r}): {error}")
        raise error
    trace.paused = combine("pause_generation", answers)
    trace.seconds["pause"] = time.monotonic() - t0
