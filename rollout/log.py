"""The server's own log: one line per event on stderr, `[rollout] ...`, at every --log-level
(start-up, the ready banner's neighbours, requests, pauses, weight pushes, errors, shutdown).
Python logging (--log-level) stays for the libraries' and the engine's diagnostics."""
import sys


def log(msg: str) -> None:
    print(f"[rollout] {msg}", file=sys.stderr, flush=True)
