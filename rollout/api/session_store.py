"""The session store: `Sessions`, the open sessions of one API server (ServerState.sessions), and
`Session`, one of them: the engine's streaming-input request its turns feed, its counts, and
why it ended. The rules it keeps (one turn at a time, n = 1, closing a full or idle session)
are listed with the routes in rollout/api/sessions.py.
"""
import asyncio
import collections
import time
import uuid
import weakref
from typing import AsyncGenerator

from engine.core.streaming import StreamingInput, check_streaming_params
from engine.errors import InvalidRequestError
from engine.frontend.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from rollout.api.errors import APIError, engine_error

MAX_CLOSED_REMEMBERED = 4096  # a turn on a recently closed session says why it was closed


class Session:
    def __init__(self, session_id: str, timeout_s: float):
        self.id = session_id
        self.request_id = f"session-{session_id}"
        self.timeout_s = timeout_s
        self.opened = self.last_used = time.monotonic()
        self.inputs: asyncio.Queue[StreamingInput] = asyncio.Queue()
        self.stream: AsyncGenerator[RequestOutput, None] | None = None  # the engine request, from turn 1 on
        self.turn_ref: weakref.ref | None = None  # the turn (its generator) that holds the session
        self.num_tokens = 0  # the conversation so far: every turn's input and output
        self.num_turns = 0
        self.ended: str | None = None  # why it takes no more turns

    @property
    def busy(self) -> bool:
        """A turn holds the session: from the check that admitted it until it ends. A weak
        reference, so a turn whose generator never started (its client left before the
        response began; nothing reached the engine) lets go when it is dropped."""
        return self.turn_ref is not None and self.turn_ref() is not None

    async def _chunks(self):
        while True:
            yield await self.inputs.get()

    def info(self) -> dict:
        now = time.monotonic()
        return {"session_id": self.id, "num_tokens": self.num_tokens, "num_turns": self.num_turns,
                "busy": self.busy, "age_s": round(now - self.opened, 3),
                "idle_s": 0.0 if self.busy else round(now - self.last_used, 3), "timeout_s": self.timeout_s}


class Sessions:
    """The open sessions of one API server (ServerState.sessions)."""

    def __init__(self, state, default_timeout_s: float, max_sessions: int):
        self.state = state
        self.default_timeout_s = default_timeout_s
        self.max_sessions = max_sessions
        self.open: dict[str, Session] = {}
        self.closed: collections.OrderedDict[str, str] = collections.OrderedDict()  # recent ids -> why

    def missing(self, session_id: str, param: str) -> APIError:
        why = self.closed.get(session_id)
        if why is not None:
            return APIError(404, f"session {session_id!r} was closed: {why}", param)
        return APIError(404, f"no open session {session_id!r} (never opened, or closed long ago)", param)

    def create(self, session_id: str | None, timeout_s: float | None) -> Session:
        self.state.check_can_generate()
        sid = session_id or uuid.uuid4().hex
        if sid in self.open:
            raise APIError(409, f"session {sid!r} is already open", "session_id")
        self.closed.pop(sid, None)
        if len(self.open) >= self.max_sessions:
            raise APIError(429, f"{len(self.open)} sessions are open, the limit (--max-sessions); close some",
                           "session_id")
        s = self.open[sid] = Session(sid, timeout_s or self.default_timeout_s)
        return s

    def get(self, session_id: str) -> Session:
        s = self.open.get(session_id)
        if s is None:
            raise self.missing(session_id, "session_params.id")
        if s.stream is not None and s.ended is None and not self.state.engine.has_request(s.request_id):
            s.ended = "its engine request was aborted (a pause in mode abort, /abort_requests)"
        if s.ended is not None:
            raise APIError(409, f"session {session_id!r} ended: {s.ended}; close it", "session_params.id")
        return s

    async def close(self, s: Session, reason: str = "closed") -> dict:
        """End the session's engine request (its KV is freed) and forget it. A stream that a turn
        is reading cannot be closed from here: its request is aborted, and the turn, which sees
        the abort, closes the stream as it ends."""
        s.ended = s.ended or reason
        if self.open.get(s.id) is s:  # (not a session opened since under the same id)
            del self.open[s.id]
            self.closed[s.id] = s.ended
            while len(self.closed) > MAX_CLOSED_REMEMBERED:
                self.closed.popitem(last=False)
        if s.stream is not None and s.stream.ag_running:
            await self.state.engine.abort(s.request_id)
        elif s.stream is not None:
            stream, s.stream = s.stream, None
            await stream.aclose()  # aborts the engine request unless it already ended
        return {"session_id": s.id, "num_tokens": s.num_tokens, "num_turns": s.num_turns}

    async def close_all(self, reason: str) -> None:
        for s in list(self.open.values()):
            await self.close(s, reason)

    async def expire_forever(self, every_s: float = 1.0) -> None:
        """Close sessions idle for longer than their timeout."""
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for s in list(self.open.values()):
                if not s.busy and now - s.last_used > s.timeout_s:
                    await self.close(s, f"idle for more than {s.timeout_s:g} s")

    # ---- one turn ---------------------------------------------------------------------------------
    def start_turn(self, s: Session, ids: list[int], params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Check the turn and claim the session for it, without awaiting: of turns sent at once,
        the first here runs and the others get 409. Returns the turn's outputs (see turn())."""
        self.check_turn(s, ids, params)
        turn = self.turn(s, ids, params)
        s.turn_ref = weakref.ref(turn)
        return turn

    def check_turn(self, s: Session, ids: list[int], params: SamplingParams) -> None:
        if s.busy:
            raise APIError(409, f"session {s.id!r} is generating a turn; one turn at a time", "session_params.id")
        try:
            check_streaming_params(params)
        except InvalidRequestError as e:
            field = "n" if params.n != 1 else "stop" if params.stop else ""
            raise APIError(400, f"in a session: {e}", "sampling_params." + field if field else "sampling_params") \
                from e
        limit = self.state.engine.max_model_len
        if s.num_tokens + len(ids) >= limit:
            raise APIError(400, f"the session holds {s.num_tokens} tokens; {len(ids)} more would reach the "
                                f"context length ({limit} tokens, max_model_len)", "prompt")

    async def turn(self, s: Session, ids: list[int], params: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """Send one turn's input and yield the turn's outputs (deltas) until it ends; start_turn
        claimed the session for it. If the caller stops early (its client went away), the
        session ends: its context holds tokens the client never saw."""
        state = self.state
        if s.ended is not None:  # closed between the claim and the first step (shutdown)
            s.turn_ref = None
            raise self.missing(s.id, "session_params.id")
        done = False
        arrival = time.monotonic()
        num_new, first_token, reason = 0, None, None
        record = state.track(s.request_id, arrival, params)  # (an abort's manifest holds this turn's tokens)
        state.metrics.request_started()
        try:
            s.inputs.put_nowait(StreamingInput(ids, params))
            if s.stream is None:
                s.stream = state.engine.generate(s._chunks(), params, s.request_id)
            async for out in s.stream:
                c = out.outputs[0]
                num_new += len(c.token_ids)
                if first_token is None and c.token_ids:
                    first_token = time.monotonic()
                record.see(out)
                if c.finish_reason is not None:
                    done, reason = True, c.finish_reason
                    if out.finished:  # ended for good: aborted (pause mode abort, /abort_requests)
                        s.ended = s.ended or f"its engine request ended ({c.finish_reason})"
                yield out
                if done:
                    break
            else:
                s.ended = s.ended or "its engine request ended"
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            s.ended = s.ended or f"its engine request failed: {e}"
            raise engine_error(e, "prompt") from e
        finally:
            state.untrack(s.request_id)
            state.metrics.request_ended()
            s.turn_ref = None
            s.last_used = time.monotonic()
            if done:
                s.num_tokens += len(ids) + num_new
                s.num_turns += 1
                state.metrics.observe_request(arrival, first_token, len(ids), num_new, [reason])
                s.ended = s.ended or self.full(s)
            elif s.ended is None:
                s.ended = "a turn's client went away before the turn ended"
            if s.ended is not None:
                await self.close(s)  # (again, if closed meanwhile: the stream is this turn's to close)

    def full(self, s: Session) -> str | None:
        """Why the session takes no more turns if it has no room left: a turn needs one token of
        input and one of output (check_turn)."""
        limit = self.state.engine.max_model_len
        if s.num_tokens + 2 > limit:
            return f"it filled the context ({s.num_tokens} of {limit} tokens, max_model_len)"
        return None
