"""Over real HTTP: /generate's sampling masks (sampling_params.return_sampling_mask, streamed and
not) and POST /logprobs/compare (client.compare_logprobs).

Tolerances: the session server runs float32 in its default mode, where a token's logits depend
on the batch it ran in and on prefill vs decode kernels (different summation orders): a
teacher-forced recompute differs from the sampled logprob by ~1e-6..1e-5 nats, so 1e-3 is the
bound here (a real mismatch, other weights or another temperature, is > 1e-2). A server with
--batch-invariant (the slow tests at the end, their own server) recomputes the same bits: 0.0.
"""
import asyncio

import httpx
import pytest
from safetensors.torch import load_file

from rollout.client import AsyncRolloutClient, RolloutAPIError, RolloutClient
from tests.rollout.conftest import ADMIN_KEY, API_KEY, MAX_MODEL_LEN, start_server, stop_server

USER = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "Write a short poem about the sea."
TOL = 1e-3


def prompt_ids(client) -> list[int]:
    return client.tokenize(PROMPT)


# ---- sampling masks ----------------------------------------------------------------------------
def test_sampling_mask_over_generate(client):
    ids = prompt_ids(client)
    out, = client.generate(ids, {"max_tokens": 8, "temperature": 1.0, "top_k": 5, "seed": 3, "logprobs": 0,
                                 "ignore_eos": True, "return_sampling_mask": "ids"})
    m = out.sampling_mask
    assert m.num_kept == [5] * 8 and [len(s) for s in m.ids] == [5] * 8
    assert all(t in s for t, s in zip(out.token_ids, m.ids))
    assert all(lo <= mass <= 0 for lo, mass in zip(m.min_logprob, m.kept_logmass))
    # "threshold" (or true): the same sets' sizes and thresholds, no ids; the draw is the same
    for value in ("threshold", True):
        again, = client.generate(ids, {"max_tokens": 8, "temperature": 1.0, "top_k": 5, "seed": 3, "ignore_eos": True,
                                       "return_sampling_mask": value})
        assert again.token_ids == out.token_ids and again.sampling_mask.ids == [None] * 8
        assert again.sampling_mask.num_kept == m.num_kept and again.sampling_mask.min_logprob == m.min_logprob
    plain, = client.generate(ids, {"max_tokens": 8, "temperature": 1.0, "top_k": 5, "seed": 3, "ignore_eos": True})
    assert plain.sampling_mask is None and plain.token_ids == out.token_ids


def test_sampling_mask_streamed_equals_the_whole(client):
    """NDJSON deltas carry each new token's mask; joined, they are the non-streamed answer."""
    params = {"max_tokens": 10, "temperature": 0.8, "top_p": 0.9, "min_p": 0.02, "seed": 5, "ignore_eos": True,
              "logprobs": 0, "return_sampling_mask": "ids"}
    whole, = client.generate(prompt_ids(client), params)
    tokens, masks = [], {"num_kept": [], "min_logprob": [], "kept_logmass": [], "ids": []}
    for _, deltas in client.generate_stream(prompt_ids(client), params):
        for d in deltas:
            tokens += d.token_ids
            if d.token_ids:
                assert len(d.sampling_mask.num_kept) == len(d.token_ids)
                for k in masks:
                    masks[k] += getattr(d.sampling_mask, k)
    assert tokens == whole.token_ids
    assert masks == {k: getattr(whole.sampling_mask, k) for k in masks}
    assert all(t in s for t, s in zip(whole.token_ids, whole.sampling_mask.ids) if s is not None)


@pytest.mark.parametrize("value, status", [("all", 400), (1, 400), (None, 400), ("ids", 400)])
def test_bad_sampling_mask_values_are_400_naming_the_field(server, value, status):
    """("ids" without top-k / top-p / min-p: every set would be the vocabulary.)"""
    body = {"prompt": "Hi", "sampling_params": {"max_tokens": 2, "temperature": 1.0, "return_sampling_mask": value}}
    r = httpx.post(server.url + "/generate", json=body, headers=USER, timeout=60)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == "sampling_params.return_sampling_mask", r.text


# ---- /logprobs/compare ------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compare_matches_what_generate_returned(client, temperature):
    ids = prompt_ids(client)
    out, = client.generate(ids, {"max_tokens": 12, "temperature": temperature, "seed": 1, "logprobs": 0,
                                 "ignore_eos": True})
    got = client.compare_logprobs(ids, out.token_ids, out.logprobs, out.weight_versions, temperature=temperature)
    assert got["weight_version"] == out.weight_versions[0] == client.weight_version()
    assert got["num_tokens"] == 12 and len(got["diffs"]) == len(got["logprobs"]) == 12
    assert got["max_abs_diff"] < TOL, got
    assert got["max_abs_diff"] == max(abs(d) for d in got["diffs"]) == abs(got["diffs"][got["max_abs_diff_index"]])
    assert 0 <= got["mean_abs_diff"] <= got["max_abs_diff"] and got["batch_invariant"] is False
    # another temperature is another distribution: the route applies the one it is given
    other = client.compare_logprobs(ids, out.token_ids, out.logprobs, temperature=temperature + 0.5)
    assert other["max_abs_diff"] > 1e-2


def test_compare_with_truncated_logprobs_needs_the_kept_mass(client):
    """top-p renormalises the sampled logprob over the kept set: adding the mask's kept_logmass
    gives the untruncated logprob, which is what the recompute has."""
    ids = prompt_ids(client)
    out, = client.generate(ids, {"max_tokens": 10, "temperature": 1.0, "top_p": 0.7, "seed": 2, "logprobs": 0,
                                 "ignore_eos": True, "return_sampling_mask": True})
    assert client.compare_logprobs(ids, out.token_ids, out.logprobs)["max_abs_diff"] > 1e-2
    untruncated = [lp + mass for lp, mass in zip(out.logprobs, out.sampling_mask.kept_logmass)]
    assert client.compare_logprobs(ids, out.token_ids, untruncated)["max_abs_diff"] < TOL


def test_compare_greedy_logprobs_at_temperature_zero(client):
    ids = prompt_ids(client)
    out, = client.generate(ids, {"max_tokens": 6, "temperature": 0, "logprobs": 0, "ignore_eos": True})
    assert client.compare_logprobs(ids, out.token_ids, out.logprobs, temperature=0)["max_abs_diff"] < TOL


def test_another_weight_version_is_409_unless_allowed(client):
    ids = prompt_ids(client)
    out, = client.generate(ids, {"max_tokens": 4, "temperature": 1.0, "seed": 4, "logprobs": 0, "ignore_eos": True})
    live = client.weight_version()
    for stale in (live + 7, [live, live, live + 7, live]):
        with pytest.raises(RolloutAPIError) as e:
            client.compare_logprobs(ids, out.token_ids, out.logprobs, weight_version=stale)
        assert e.value.status == 409 and e.value.param == "weight_version", e.value
        assert str(live + 7) in e.value.message and "allow_version_mismatch" in e.value.message
    got = client.compare_logprobs(ids, out.token_ids, out.logprobs, weight_version=live + 7,
                                  allow_version_mismatch=True)
    assert got["weight_version"] == live and got["max_abs_diff"] < TOL


def _bad_bodies(ids: list[int]) -> list[tuple[dict, str]]:
    good = {"prompt_token_ids": ids, "token_ids": [100, 200, 300], "logprobs": [-1.0, -2.0, -3.0]}
    return [
        ({**good, "logprobs": [-1.0, -2.0]}, "logprobs"),  # one logprob per token
        ({**good, "token_ids": []}, "token_ids"),
        ({**good, "prompt_token_ids": []}, "prompt_token_ids"),
        ({**good, "logprobs": []}, "logprobs"),
        ({**good, "token_ids": [1] * MAX_MODEL_LEN, "logprobs": [-1.0] * MAX_MODEL_LEN}, "token_ids"),  # > context
        ({**good, "token_ids": [100, 10 ** 9, 300]}, "token_ids"),  # outside the vocabulary
        ({**good, "prompt_token_ids": [-1] + ids}, "prompt_token_ids"),
        ({**good, "weight_version": [0, 0]}, "weight_version"),  # one version per token, or one
        ({**good, "temperature": -1.0}, "temperature"),
        ({**good, "logprobs": ["x", -2.0, -3.0]}, "logprobs[0]"),
        ({**good, "extra": 1}, "extra"),
        ({k: v for k, v in good.items() if k != "logprobs"}, "logprobs"),
    ]


def test_malformed_bodies_are_400_naming_the_field(server, client):
    ids = prompt_ids(client)
    for body, param in _bad_bodies(ids):
        r = httpx.post(server.url + "/logprobs/compare", json=body, headers=USER, timeout=60)
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"] == param, (param, r.text)
    # NaN is no logprob (Python's JSON reader takes it)
    r = httpx.post(server.url + "/logprobs/compare", headers={**USER, "Content-Type": "application/json"},
                   content=b'{"prompt_token_ids": [1, 2], "token_ids": [3], "logprobs": [NaN]}', timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text
    assert httpx.get(server.url + "/health", timeout=30).json() == {"status": "ok"}


def test_compares_and_generations_at_once(server, client):
    """Eight compares and four generations (two with sampling masks) concurrently: each compare
    matches its own sequence, each mask its own tokens."""
    ids = prompt_ids(client)
    outs = client.generate([ids, ids[:-2], ids[1:], ids[:5]], {"max_tokens": 8, "temperature": 1.0, "seed": 9,
                                                               "logprobs": 0, "ignore_eos": True})
    prompts = [ids, ids[:-2], ids[1:], ids[:5]]

    async def main():
        async with AsyncRolloutClient(server.url, api_key=API_KEY, timeout=120) as c:
            compares = [c.compare_logprobs(p, o.token_ids, o.logprobs, o.weight_versions)
                        for p, o in zip(prompts * 2, outs * 2)]
            gens = [c.generate(p, {"max_tokens": 8, "temperature": 1.0, "ignore_eos": True, "top_k": 3 + i,
                                   "return_sampling_mask": "ids" if i % 2 else False}) for i, p in enumerate(prompts)]
            return await asyncio.gather(*compares, *gens)

    results = asyncio.run(main())
    for got, out in zip(results[:8], outs * 2):
        assert got["max_abs_diff"] < TOL and got["num_tokens"] == len(out.token_ids)
    for i, (out,) in enumerate(results[8:]):
        assert len(out.token_ids) == 8
        if i % 2:
            assert out.sampling_mask.num_kept == [3 + i] * 8
            assert all(t in s for t, s in zip(out.token_ids, out.sampling_mask.ids))
        else:
            assert out.sampling_mask is None


# ---- a batch-invariant server: exact, and a push -------------------------------------------
@pytest.fixture(scope="module", params=[(), ("--async-scheduling",)], ids=["", "async-scheduling"])
def invariant_server(request):
    """(Also with async scheduling: the next step scheduled while one runs changes no bit.)"""
    server = start_server("--batch-invariant", *request.param)
    yield server
    assert stop_server(server) == 0, server.log()


@pytest.mark.slow
def test_batch_invariant_compare_is_exact_and_a_push_is_caught(invariant_server):
    with RolloutClient(invariant_server.url, api_key=API_KEY, admin_api_key=ADMIN_KEY, timeout=120) as client:
        ids = prompt_ids(client)
        outs = client.generate([ids, ids[:-3]], {"max_tokens": 10, "temperature": 0.8, "seed": 6, "logprobs": 0,
                                                 "ignore_eos": True})
        for p, out in zip([ids, ids[:-3]], outs):
            got = client.compare_logprobs(p, out.token_ids, out.logprobs, out.weight_versions, temperature=0.8)
            assert got["batch_invariant"] is True and got["diffs"] == [0.0] * 10, got
        # other weights: the old version is refused; compared anyway, the logprobs moved
        old = client.weight_version()
        original = load_file(client.server_info()["model_path"] + "/model.safetensors")["model.norm.weight"]
        new = client.push_weights_shared([("model.norm.weight", original * 0.5)])["weight_version"]
        assert new > old
        out = outs[0]
        with pytest.raises(RolloutAPIError) as e:
            client.compare_logprobs(ids, out.token_ids, out.logprobs, out.weight_versions, temperature=0.8)
        assert e.value.status == 409 and e.value.param == "weight_version"
        moved = client.compare_logprobs(ids, out.token_ids, out.logprobs, out.weight_versions, temperature=0.8,
                                        allow_version_mismatch=True)
        assert moved["weight_version"] == new and moved["max_abs_diff"] > 0.1, moved
        # tokens of the new weights compare exactly again
        fresh, = client.generate(ids, {"max_tokens": 6, "temperature": 1.0, "seed": 6, "logprobs": 0})
        assert set(fresh.weight_versions) == {new}
        assert client.compare_logprobs(ids, fresh.token_ids, fresh.logprobs, new)["max_abs_diff"] == 0.0
