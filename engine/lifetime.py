"""Child processes that die with their parent: no orphan survives a killed engine.

`child_argv(call, parent)` starts Python with PR_SET_PDEATHSIG as its very first statement (before
the seconds of imports, during which nothing else would notice the parent's death), then runs
`call`; the child's entry point then calls `die_with_parent`, which adds a watchdog thread for
what the signal misses (a parent that died before prctl took effect).
"""
import ctypes
import os
import signal
import sys
import threading

PARENT_DEATH_SIGNAL = signal.SIGUSR1  # not SIGTERM: that one means a normal stop


def child_argv(call: str, parent_pid: int) -> list[str]:
    """argv for `subprocess.Popen` of a child running `call` ("from m import f; f(...)")."""
    boot = (f"import ctypes, os, signal; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL); "
            f"os.getppid() == {parent_pid} or os._exit(1); ")
    return [sys.executable, "-c", boot + call]


def child_env() -> dict:
    """The environment of a child: it imports what this process can (worker extensions, an
    uninstalled checkout)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))


def die_with_parent(parent_pid: int, on_death=None) -> None:
    """Exit when the parent process dies (`on_death()` first, if given: it must exit). Linux
    sends SIGKILL, or PARENT_DEATH_SIGNAL when `on_death` is given (the caller's handler for it
    must call on_death); a watchdog thread covers the rest."""
    death_signal = signal.SIGKILL if on_death is None else PARENT_DEATH_SIGNAL
    on_death = on_death or (lambda: os._exit(1))
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, death_signal)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watchdog():
        while True:
            if os.getppid() != parent_pid:
                on_death()
            threading.Event().wait(1.0)

    threading.Thread(target=watchdog, daemon=True, name="parent-watchdog").start()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        on_death()
