"""Images over HTTP on a real `rollout serve` of a tiny random Idefics3: image_url parts (data
URLs) in /v1/chat/completions and multi_modal_data in /generate, greedy token-exact against
transformers; /metrics counts an encoder-cache hit for a repeated image; the cache is empty after
/reset_mm_cache and after a weight update; a bad image is a 400 and the server keeps serving."""
import base64
import io

import httpx
import pytest

from rollout.client import RolloutClient
from rollout.subprocess_server import served
from tests.engine.test_multimodal import build_vlm, random_image, reference

GREEDY = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_model_path):
    root = tmp_path_factory.mktemp("vlm_http")
    model, processor = build_vlm(root / "model", default_model_path)
    with served(str(root / "model"), "--dtype", "float32", log_path=root / "serve.log") as server:
        with RolloutClient(server.url, timeout=60) as client:
            yield client, server.url, model, processor


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_images_in_chat_and_generate(setup):
    client, url, model, processor = setup
    image = random_image(48, 40, 11)
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is in "},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}},
                                             {"type": "text", "text": "?"}]}]
    body = {"messages": messages, "return_token_ids": True, **GREEDY}
    out = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    text = processor.apply_chat_template([{"role": "user", "content": [
        {"type": "text", "text": "What is in "}, {"type": "image"}, {"type": "text", "text": "?"}]}],
        add_generation_prompt=True, tokenize=False)
    assert out["choices"][0]["token_ids"] == reference(model, processor, text, [image])
    hits = metric(url, "rollout_encoder_cache_hits_total")
    gen = httpx.post(url + "/generate", json={"prompt": text, "multi_modal_data": {"image": [data_url(image)]},
                                             "sampling_params": GREEDY}, timeout=60).json()
    assert gen["results"][0]["outputs"][0]["token_ids"] == out["choices"][0]["token_ids"]
    assert metric(url, "rollout_encoder_cache_hits_total") == hits + 1  # the same image: encoded once
    assert metric(url, "rollout_encoder_cache_usage_ratio") > 0
    assert httpx.post(url + "/reset_mm_cache", timeout=30).json() == {"success": True}
    assert metric(url, "rollout_encoder_cache_usage_ratio") == 0
    httpx.post(url + "/generate", json={"prompt": text, "multi_modal_data": {"image": [data_url(image)]},
                                        "sampling_params": GREEDY}, timeout=60).raise_for_status()
    assert metric(url, "rollout_encoder_cache_usage_ratio") > 0
    client.pause()
    client.reload_weights()  # a weight update: no encoder output of the old weights survives
    client.resume()
    assert metric(url, "rollout_encoder_cache_usage_ratio") == 0


def test_bad_images_are_400s(setup):
    client, url, _, _ = setup
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    r = httpx.post(url + "/v1/chat/completions", json={"messages": bad, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and "image" in r.text
    image = data_url(random_image(8, 8, 12))
    r = httpx.post(url + "/generate", json={"prompt": "no marker", "multi_modal_data": {"image": [image]}}, timeout=60)
    assert r.status_code == 400 and "marker" in r.text
    for path in ("/etc/hostname", "file:///etc/hostname"):  # the server's files are not images to read
        r = httpx.post(url + "/generate", json={"prompt": "<image>", "multi_modal_data": {"image": [path]}},
                       timeout=60)
        assert r.status_code == 400 and "data URL" in r.text
    assert client.generate("still serving", {"max_tokens": 2})[0].token_ids


def test_render_refuses_images(setup):
    """/v1/chat/completions/render (vLLM's, what TRL's image_features calls) answers vLLM's
    MultiModalFeatures for images, a format this engine does not produce: 501 naming `messages`."""
    _, url, _, _ = setup
    image = {"type": "image_url", "image_url": {"url": data_url(random_image(16, 16, 5))}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    r = httpx.post(url + "/v1/chat/completions/render", json={"messages": messages, "max_tokens": 1}, timeout=60)
    assert r.status_code == 501 and r.json()["error"]["param"] == "messages", r.text
