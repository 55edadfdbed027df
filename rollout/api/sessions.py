"""RL sessions over HTTP: multi-turn rollouts whose KV stays on the engine between turns.
SGLang's route names (open a session, pass `session_params` to /generate, close it); each
session is one streaming-input request of the engine (engine/core/streaming.py).

    POST /open_session  {"session_id"?: str, "timeout_s"?: float}  -> {"session_id", "timeout_s"}
    POST /generate      {"prompt_token_ids" | "prompt" | "messages", "sampling_params",
                         "session_params": {"id": session_id}}     -> /generate's answer for the turn
    POST /close_session {"session_id"}  -> {"session_id", "num_tokens", "num_turns"}
    GET  /sessions      -> the open sessions

A session's first turn sends the prompt; every later turn appends its tokens (a tool's answer,
an observation, the next user message) after everything so far, the tokens the model generated
included, and samples the next turn. The turns' concatenation is token-exact equal to one
request over the whole conversation (greedy; tested against that). A turn's answer has the
turn's own input as prompt_token_ids and its new tokens with logprobs and weight versions.

The rules, each an explicit choice:
- One turn at a time (a second one meanwhile: 409, the session untouched). The turn that passes
  the check claims the session before anything awaits, so of turns sent at once exactly one
  runs; only that turn reads the engine request's output stream (the stream's one consumer).
- n = 1; no stop strings (the engine keeps every token it generated: a stop string would cut
  text the context still holds); stop on token ids (stop_token_ids, EOS) instead. A turn that
  would overflow the context is a 400 and leaves the session as it was.
- A turn that leaves no room for another (cut off at max_model_len, finish_reason "length",
  or ending one token short of it) closes the session at once and frees its KV: no later turn
  could pass the check above, so keeping it would only hold KV until the idle timeout. The
  turn's answer says so ("session": {"closed": why}, unless streamed); the next turn or close
  is a 404 that says it filled the context.
- A session idle for longer than its timeout_s (--session-timeout-s by default) is closed and
  its KV freed; so is one whose turn's client went away mid-turn (the client lost tokens the
  context holds), and every session at shutdown. A turn on a closed session: 404.
- Pause mode keep or wait leaves sessions open (a turn sent while paused runs after resume);
  mode abort ends them (their engine requests are aborted, their KV freed): an idle one answers
  409 afterwards; one in the middle of a turn gets its tokens so far (finish_reason "abort")
  and is closed (404 afterwards). /abort_requests ends those in the middle of a turn.
- Weights: after a push an idle session's KV is the one the old weights computed (vLLM's keep;
  the next turn's tokens carry the new version); push or pause with recompute_kv=true makes it
  recompute under the new weights first. Sleep frees it; the next turn recomputes it.
- Sessions live in the API server that opened them: with several API servers
  (--api-server-count) a turn must reach the same process, so run sessions with one.
"""
from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.frontend.async_llm import merge_delta
from engine.frontend.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from rollout.api.cancel import until_disconnect
from rollout.api.errors import APIError
from rollout.api.output_json import request_output_json, usage_json
from rollout.api.protocol import CloseSessionBody, OpenSessionBody
from rollout.api.state import get_state

router = APIRouter(tags=["generate"])


def merge_turn(outs: list[RequestOutput], ids: list[int]) -> RequestOutput:
    """The deltas of one turn as one output whose prompt is the turn's input."""
    first = outs[0]
    for o in outs[1:]:
        merge_delta(first, o)
    first.prompt_token_ids = ids
    return first


async def generate_turn(request: Request, session_id: str, field: str, ids: list[int], params: SamplingParams,
                        stream: bool, frame, done_frame: bytes | None):
    """/generate with session_params: the turn's answer (or its stream of deltas)."""
    sessions = get_state(request).sessions
    s = sessions.get(session_id)
    if field == "messages" and s.num_turns:
        raise APIError(400, "only a session's first turn may be 'messages' (a chat template renders a whole "
                            "conversation); send later turns as prompt_token_ids", "messages")
    turn = sessions.start_turn(s, ids, params)  # no await since get(): one turn passes
    if not stream:
        async def collect():
            try:
                return [o async for o in turn]
            finally:
                await turn.aclose()

        out = merge_turn(await until_disconnect(request, collect()), ids)
        session = {"id": s.id, "num_tokens": s.num_tokens, "num_turns": s.num_turns}
        return {"results": [request_output_json(out)], "usage": usage_json([out]),
                "session": dict(session, closed=s.ended) if s.ended else session}

    async def events():
        try:
            async for o in turn:
                o.prompt_token_ids = ids
                yield frame(dict(request_output_json(o), prompt_index=0))
        finally:
            await turn.aclose()
        if done_frame is not None:
            yield done_frame

    return StreamingResponse(events(), media_type="text/event-stream" if done_frame else "application/x-ndjson",
                             headers={"X-Session-Id": s.id})


@router.post("/open_session")
async def open_session(body: OpenSessionBody, request: Request):
    """Open a session (the engine request starts with its first turn)."""
    s = request.app.state.rollout.sessions.create(body.session_id, body.timeout_s)
    return {"session_id": s.id, "timeout_s": s.timeout_s}


@router.post("/close_session")
async def close_session(body: CloseSessionBody, request: Request):
    """Close a session and free its KV; closing one that already ended (timed out, aborted) says why."""
    sessions = request.app.state.rollout.sessions
    s = sessions.open.get(body.session_id)
    if s is None:
        raise sessions.missing(body.session_id, "session_id")
    if s.busy:
        raise APIError(409, f"session {s.id!r} is generating a turn; close it when the turn has ended", "session_id")
    ended = s.ended
    result = await sessions.close(s)
    return dict(result, ended=ended) if ended else result


@router.get("/sessions")
async def list_sessions(request: Request):
    return {"sessions": [s.info() for s in request.app.state.rollout.sessions.open.values()]}
