"""RolloutClient / AsyncRolloutClient beyond generation: typed results, the async twin agrees
with the sync client, idempotent calls retry on connection errors, and errors carry the
server's message and field."""
import asyncio

import httpx
import pytest

from rollout.client import AsyncRolloutClient, GenerateOutput, RolloutAPIError, RolloutClient
from rollout.errors import RolloutConnectionError
from tests.rollout.conftest import ADMIN_KEY, API_KEY

PROMPT = "The capital of France is"
GREEDY = {"temperature": 0, "max_tokens": 5, "ignore_eos": True, "logprobs": 0}


def test_async_client_matches_sync_client(server, client):
    [want] = client.generate(PROMPT, GREEDY)
    assert isinstance(want, GenerateOutput)

    async def main():
        async with AsyncRolloutClient(server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY) as c:
            [out] = await c.generate(PROMPT, GREEDY)
            deltas = [d async for _, ds in c.generate_stream(PROMPT, GREEDY) for d in ds]
            info = await c.server_info(), await c.is_paused(), await c.is_sleeping(), await c.get_world_size()
            return out, deltas, info

    out, deltas, (info, paused, sleeping, world) = asyncio.run(main())
    assert out.token_ids == want.token_ids and out.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert [t for d in deltas for t in d.token_ids] == want.token_ids
    assert info["dtype"] == "float32" and paused is False and sleeping is False and world == 1
    assert client.models() == [info["model"]]
    assert client.model_info()[0]["root"] == info["model_path"]
    assert client.health() is True


def test_errors_carry_message_and_field(client):
    with pytest.raises(RolloutAPIError) as e:
        client.generate(PROMPT, {"top_p": 5})
    assert e.value.status == 400 and e.value.param == "sampling_params.top_p" and "top_p" in e.value.message
    with pytest.raises(ValueError):
        client.generate(["text", [1, 2]])  # mixed batch: refused before sending


def test_idempotent_calls_retry_connection_errors(server):
    calls = {"n": 0}
    real = httpx.HTTPTransport()

    class Flaky(httpx.BaseTransport):
        def handle_request(self, request):
            calls["n"] += 1
            if calls["n"] <= 2:
                raise httpx.ConnectError("refused", request=request)
            return real.handle_request(request)

    c = RolloutClient(server.url, api_key=API_KEY, retries=3)
    c.http = httpx.Client(transport=Flaky())
    assert c.is_paused() is False and calls["n"] == 3  # two failures, then success
    calls["n"] = 0
    with pytest.raises(RolloutConnectionError) as e:  # a POST is never retried
        c.generate(PROMPT, GREEDY)
    assert calls["n"] == 1 and isinstance(e.value.__cause__, httpx.ConnectError)


def test_no_server_is_a_clear_connection_error():
    """Nobody listens on the port: an error that names the URL and how to start a server, with
    httpx's error chained; the same from every kind of call (once retried, streamed, async)."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago and that nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    with RolloutClient(url, retries=1) as c:
        for call in (lambda: c.generate(PROMPT, GREEDY), c.is_paused, lambda: list(c.generate_stream(PROMPT))):
            with pytest.raises(RolloutConnectionError) as e:
                call()
            assert url in str(e.value) and "rollout serve" in str(e.value) and e.value.url == url
            assert isinstance(e.value.__cause__, httpx.ConnectError) and isinstance(e.value, ConnectionError)

    async def main():
        async with AsyncRolloutClient(url, retries=0) as c:
            with pytest.raises(RolloutConnectionError):
                await c.generate(PROMPT, GREEDY)
            with pytest.raises(RolloutConnectionError):
                [d async for d in c.generate_stream(PROMPT)]

    asyncio.run(main())
