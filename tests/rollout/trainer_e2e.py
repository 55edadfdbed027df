"""A real trainer process driving `rollout serve` over HTTP (no engine imports):

    python -m tests.rollout.trainer_e2e URL API_KEY ADMIN_KEY MODE PROMPTS_JSON

MODE "client": only rollout.RolloutClient: generate with logprobs, push perturbed weights
(pause -> broadcast -> swap -> resume, one call), generate again; the client logs the push to
the trainer's own (offline) W&B run.
MODE "vllm": plain httpx, making the calls exactly as vLLM documents its RL HTTP API (the
weight-transfer guide, docs.vllm.ai/en/latest/training/weight_transfer, and its example
examples/online_serving/rlhf_http_nccl.py): /pause, /sleep + /wake_up, /init_weight_transfer_engine,
/start_weight_update, /update_weights with the NCCL update_info, /finish_weight_update,
/reset_prefix_cache, /resume; our WeightSender does the broadcast, as vLLM's trainer-side
NCCL engine would. Prints one JSON line with what it saw.
"""
import json
import sys
import threading

import httpx

from tests.engine.perturb import perturbed_state
from weight_sync import WeightSender, WeightTransferGroup, find_free_port

GREEDY = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True, "logprobs": 0}


def with_client(url, api_key, admin_key, prompts, state) -> dict:
    import wandb

    from rollout import RolloutClient

    run = wandb.init(project="rollout-trainer-test", mode="offline")
    with RolloutClient(url, api_key=api_key, admin_api_key=admin_key, timeout=300, wandb_run=run) as client:
        before = client.generate(prompts, GREEDY)
        client.init_weight_transfer(backend="gloo", shared_memory_when_local=False)
        client.push_weights(state.items(), version=1)
        run.log({"train/step": 1})  # the trainer's own step commits the push's values with it
        after = client.generate(prompts, GREEDY)
        client.close_weight_transfer()
        version = client.weight_version()
    run.finish()
    return {"before": [o.token_ids for o in before], "after": [o.token_ids for o in after],
            "after_versions": [o.weight_versions for o in after], "after_logprobs": [o.logprobs for o in after],
            "version": version}


def vllm_style(url, api_key, admin_key, prompts, state) -> dict:
    headers = {"Authorization": f"Bearer {admin_key}"}
    http = httpx.Client(base_url=url, headers=headers, timeout=300)

    def gen():
        r = http.post("/generate", json={"prompt_token_ids": prompts, "sampling_params": GREEDY})
        r.raise_for_status()
        return r.json()

    before = gen()
    http.post("/pause", params={"mode": "keep"}).raise_for_status()
    http.post("/sleep", params={"level": 1}).raise_for_status()
    assert http.get("/is_sleeping").json()["is_sleeping"] is True
    http.post("/wake_up").raise_for_status()
    world_size = http.get("/get_world_size").json()["world_size"] + 1
    port = find_free_port()
    init_info = {"master_address": "127.0.0.1", "master_port": port, "world_size": world_size, "rank_offset": 1}
    init = threading.Thread(target=lambda: http.post("/init_weight_transfer_engine",
                                                     json={"init_info": init_info}).raise_for_status())
    init.start()
    group = WeightTransferGroup("127.0.0.1", port, 0, world_size)
    init.join()
    http.post("/start_weight_update", json={"is_checkpoint_format": True}).raise_for_status()
    names = list(state)
    update_info = {"names": names, "dtype_names": ["float32"] * len(names),
                   "shapes": [list(state[n].shape) for n in names], "packed": True}
    box = {}
    update = threading.Thread(target=lambda: box.update(r=http.post("/update_weights",
                                                                    json={"update_info": update_info})))
    update.start()
    WeightSender(group).send(state.items())
    update.join()
    box["r"].raise_for_status()
    version = box["r"].json()["weight_version"]
    http.post("/finish_weight_update", json={"weight_version": version}).raise_for_status()
    http.post("/reset_prefix_cache").raise_for_status()
    http.post("/resume").raise_for_status()
    after = gen()
    group.close()
    return {"before": _tokens(before), "after": _tokens(after), "after_versions": _field(after, "weight_versions"),
            "after_logprobs": _field(after, "logprobs"), "version": http.get("/weights/version").json()["weight_version"]}


def _field(body, key):
    return [r["outputs"][0][key] if "outputs" in r else r[key] for r in body["results"]] \
        if "results" in body else [body[key]]


def _tokens(body):
    return _field(body, "token_ids")


if __name__ == "__main__":
    url, api_key, admin_key, mode, prompts_json = sys.argv[1:6]
    prompts = json.loads(prompts_json)
    from engine.default_model import default_model_path

    state = perturbed_state(str(default_model_path()))
    fn = with_client if mode == "client" else vllm_style
    print(json.dumps(fn(url, api_key, admin_key, prompts, state)), flush=True)
