"""Streaming input: one request whose input arrives in chunks (multi-turn and tool-use rollouts).
The request keeps its KV cache between chunks, so each turn computes only its new tokens.

The whole protocol, end to end:

    caller     AsyncLLM.generate(async generator of StreamingInput, params)
    frontend   first chunk -> EngineCoreRequest(streaming=True); each later chunk ->
               StreamInput(request_id, token ids, optional new params); the generator's end ->
               StreamInput(final=True, no tokens). Outputs whose chunk ended carry its
               finish_reason with `resumable` set; the one without `resumable` ends the request.
    core       Request.stream, an InputStream: the state machine below. The scheduler asks it
               what to do when input arrives and when a chunk ends, and moves the request
               between its queues accordingly (AWAITING_INPUT requests sit in Scheduler.idle,
               holding their blocks; they are the first to give them up when blocks run out).

    InputStream states and transitions:

        GENERATING --chunk ends, a chunk is queued--------> GENERATING (the queued chunk starts)
        GENERATING --chunk ends, input open, none queued--> AWAITING_INPUT   (output: resumable)
        GENERATING --chunk ends, input closed-------------> CLOSED    (output: finished for good)
        GENERATING --chunk or close arrives---------------> GENERATING (queued / remembered)
        AWAITING_INPUT --chunk arrives--------------------> GENERATING (re-enters the waiting queue)
        AWAITING_INPUT --close arrives--------------------> CLOSED (finished; its last output
                                                             already went out, resumable)

A new chunk's tokens follow everything so far, the tokens generated for earlier chunks
included; unlike vLLM the last generated token (e.g. <|im_end|>) stays in the context, so a
conversation fed chunk by chunk is token-exact equal to one request over the whole of it.
Limits: n = 1, no stop strings (the frontend would have to cut text the core already kept),
no FINAL_ONLY outputs, no stale_action "restart". A chunk may carry new SamplingParams (max_tokens per turn, say).
"""
import enum
from collections import deque
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.protocol import StreamInput
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class StreamingInput:
    """One chunk as the caller gives it: text or token ids, and optionally new params."""

    prompt: str | list[int] | dict
    sampling_params: SamplingParams | None = None


def check_streaming_params(p: SamplingParams) -> None:
    if p.n != 1:
        raise InvalidRequestError("streaming input does not support n > 1")
    if p.output_kind == RequestOutputKind.FINAL_ONLY:
        raise InvalidRequestError("streaming input does not support output_kind FINAL_ONLY")
    if p.stop:
        raise InvalidRequestError("streaming input does not support stop strings")
    if p.stale_action == "restart":  # its earlier turns' outputs are part of the later turns' input
        raise InvalidRequestError("streaming input does not support stale_action 'restart'", "stale_action")


class StreamState(enum.Enum):
    GENERATING = "generating"
    AWAITING_INPUT = "awaiting_input"
    CLOSED = "closed"


class InputStream:
    """The core's state of one streaming-input request (see the module docstring)."""

    def __init__(self):
        self.state = StreamState.GENERATING
        self.queued: deque[StreamInput] = deque()  # chunks that arrived while one was generating
        self.closing = False  # the input is closed: the request ends with its last chunk

    def on_input(self, chunk: StreamInput) -> StreamInput | None:
        """A chunk or the close arrived; returns the chunk to start now, if any."""
        assert self.state is not StreamState.CLOSED, "input for a closed stream"
        if not chunk.prompt_token_ids:  # only closes the input
            self.closing = True
            if self.state is StreamState.AWAITING_INPUT:
                self.state = StreamState.CLOSED
            return None
        if self.state is StreamState.GENERATING:
            self.queued.append(chunk)
            return None
        self.state = StreamState.GENERATING
        self.closing = self.closing or chunk.final
        return chunk

    def on_chunk_end(self) -> StreamInput | None:
        """The current chunk finished generating; returns the queued chunk to start, if any."""
        assert self.state is StreamState.GENERATING, f"a chunk ended in state {self.state}"
        if self.queued:
            chunk = self.queued.popleft()
            self.closing = self.closing or chunk.final
            return chunk
        self.state = StreamState.CLOSED if self.closing else StreamState.AWAITING_INPUT
        return None

    @property
    def resumable(self) -> bool:
        """After a chunk ended: the request goes on (more input may come)."""
        return self.state is not StreamState.CLOSED
