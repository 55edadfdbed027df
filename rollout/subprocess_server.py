"""`rollout serve` as a child process, for recipes, benchmarks and tests: start it on any free
port, read its URL from the ready line, stop it with SIGTERM (as an orchestrator would).

    with served("--dtype", "float32", log_path="serve.log") as server:
        client = RolloutClient(server.url)
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

READY = re.compile(r"on (http://\S+)")


@dataclass
class ServerProcess:
    url: str
    proc: subprocess.Popen
    log_path: str
    stdout: list[str] = field(default_factory=list)  # its stdout lines so far: the ready banner

    def log(self, chars: int = 4000) -> str:
        return Path(self.log_path).read_text()[-chars:]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait (SIGKILL after `timeout`); returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def rollout_command() -> list[str]:
    script = Path(sys.executable).parent / "rollout"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rollout.cli"]


def start(*args: str, log_path: str | Path, env: dict | None = None, cwd: str | Path | None = None,
          timeout_s: float = 300.0) -> ServerProcess:
    """`rollout serve --port 0 *args`, its stderr in `log_path`; returns once it serves."""
    env = dict(os.environ, HF_HUB_OFFLINE=os.environ.get("HF_HUB_OFFLINE", "1"), TOKENIZERS_PARALLELISM="false",
               **(env or {}))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(rollout_command() + ["serve", "--port", "0", *args], stdout=subprocess.PIPE,
                                stderr=log, text=True, cwd=cwd, env=env)
    found: dict = {}
    lines: list[str] = []

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            m = READY.search(line)
            if m:
                found.setdefault("url", m.group(1))

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while "url" not in found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"rollout serve did not start:\n{Path(log_path).read_text()[-4000:]}")
        time.sleep(0.1)
    return ServerProcess(found["url"], proc, str(log_path), lines)


@contextlib.contextmanager
def served(*args: str, log_path: str | Path, **kwargs):
    """start(...) as a context manager that stops the server on exit."""
    server = start(*args, log_path=log_path, **kwargs)
    try:
        yield server
    finally:
        server.stop()
