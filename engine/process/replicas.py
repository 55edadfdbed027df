"""One data-parallel replica as a frontend sees it: where it is, whether it lives and takes
requests, its load, and its heartbeats."""
import hashlib
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """Where a request should run, when the caller cares: a replica by its data_parallel_rank
    (vLLM's X-data-parallel-rank header), or the replica a session key maps to (every request
    carrying that key on one replica, so each turn finds the last one's prefix blocks)."""

    data_parallel_rank: int | None = None
    session_key: str | None = None


def affinity(key: str, rank: int) -> int:
    """The weight of (key, replica) in rendezvous hashing: stable across processes (not hash())."""
    return int.from_bytes(hashlib.blake2b(f"{rank}:{key}".encode(), digest_size=8).digest(), "little")


@dataclass
class EngineState:
    """One replica as this frontend sees it."""

    index: int
    identity: bytes
    rank: int = 0  # its data_parallel_rank: its slot among the live replicas (pinning, group ranks)
    alive: bool = True
    routable: bool = True  # new requests may go there (not while joining or draining)
    num_in_flight: int = 0  # this frontend's unfinished requests there
    load: int = 0  # waiting + running there, as the DP coordinator last published it
    heartbeat_at: float | None = None  # time.monotonic() of its last heartbeat here (None: none yet)
    busy: tuple[float, str] = (0.0, "")  # that heartbeat's (seconds inside one step or call, which)

    def beat(self, hb) -> None:
        self.heartbeat_at, self.busy = time.monotonic(), (hb.busy_s, hb.doing)

    def stalled(self, timeout: float) -> dict | None:
        """{"replica", "seconds", "in"} if its last heartbeat is `timeout` seconds old or says it
        is `timeout` into one piece of work; else None (also before its first heartbeat)."""
        if self.heartbeat_at is None:
            return None
        now = time.monotonic()
        silent = now - self.heartbeat_at
        busy = self.busy[0] + silent if self.busy[0] else 0.0
        if silent >= timeout:
            return {"replica": self.index, "seconds": round(silent, 1), "in": "no heartbeat"}
        if busy >= timeout:
            return {"replica": self.index, "seconds": round(busy, 1), "in": self.busy[1]}
        return None
