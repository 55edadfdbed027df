"""The pause now in force: one object, owned by the EngineCore, which alone changes it; the
Scheduler reads `state` to decide what may run and what is held."""
import enum
import time
from dataclasses import dataclass


class PauseState(enum.Enum):
    UNPAUSED = "unpaused"
    PAUSED_NEW = "paused_new"  # pause modes abort / wait: admitted requests run on, new ones are held
    PAUSED_ALL = "paused_all"  # pause mode keep: nothing runs; requests keep their KV for the resume


@dataclass
class Pause:
    state: PauseState = PauseState.UNPAUSED
    since: float | None = None  # time.monotonic() when generation stopped (kept across a change of mode)
    by_sleep: bool = False  # made by sleep(): the wake-up that leaves nothing asleep lifts it
    deadline: float | None = None  # time.monotonic() at which it lifts itself (a pause's timeout_s)
    recompute_kv: bool = False  # keep mode: weights that go live now make the frozen requests recompute

    @property
    def active(self) -> bool:
        return self.state is not PauseState.UNPAUSED

    def enter(self, state: PauseState, by_sleep: bool = False, timeout_s: float | None = None,
              recompute_kv: bool = False) -> None:
        """Pause (or change the mode of the pause in force, which resets its other settings)."""
        self.state = state
        if self.since is None:
            self.since = time.monotonic()
        self.by_sleep = by_sleep
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self.recompute_kv = recompute_kv

    def lift(self) -> float | None:
        """Unpause; returns how long generation was paused (None if it was not)."""
        seconds = None if self.since is None else time.monotonic() - self.since
        self.state, self.since, self.by_sleep, self.deadline, self.recompute_kv = (
            PauseState.UNPAUSED, None, False, None, False)
        return seconds

    def due(self) -> bool:
        """Its timeout_s has run out."""
        return self.deadline is not None and time.monotonic() >= self.deadline

    def seconds_to_deadline(self) -> float | None:
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def seconds(self) -> float:
        """How long generation has been paused (0.0 when it is not)."""
        return 0.0 if self.since is None else time.monotonic() - self.since
