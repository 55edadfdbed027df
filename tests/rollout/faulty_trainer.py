"""A trainer that fails in the middle of a push, run as its own process by test_faults.py:

    python -m tests.rollout.faulty_trainer URL ADMIN_KEY {exit|hang} {first|middle|last} MODEL_DIR [phases|tx]

It forms the group, sends the header and the buckets before the first, middle or last one of a
push of perturbed weights, and then dies (os._exit) or stops answering (sleeps) where that
bucket should go, leaving the server's receiver waiting for the rest. The HTTP side of the push:

- phases (default): vLLM's, made by this process: pause, start an update, post /update_weights
  in a thread (as WeightTransfer.update does); the group's timeout is 8 s.
- tx: none: the caller posts POST /weights/update beside it (a trainer's controller is often
  another process than the rank that broadcasts). The group's timeout is 60 s, so only the
  update's deadline_s can end a hung push early. Prints "group formed" once it can send.
"""
import os
import sys
import threading
import time

import torch

from rollout.client import RolloutClient
from rollout.client_weights import _update_info
from tests.engine.perturb import perturbed_state
from weight_sync import WeightSender
from tests.weight_sync.partial_push import send_some_buckets

BUCKET_BYTES = 64 << 20


STOP_BEFORE = {"first": lambda n: 0, "middle": lambda n: n // 2, "last": lambda n: n - 1}


def main(url: str, key: str, how: str, where: str, model_dir: str, route: str = "phases") -> None:
    client = RolloutClient(url, admin_api_key=key, api_key=key, timeout=120)
    client.init_weight_transfer(backend="gloo", shared_memory_when_local=False, timeout_s=8 if route == "phases" else 60,
                                bucket_bytes=BUCKET_BYTES)
    named = sorted(perturbed_state(model_dir, seed=7).items())
    if route == "phases":
        client.pause(mode="keep")
        client.start_weight_update()
        caller = RolloutClient(url, admin_api_key=key, api_key=key, timeout=120)
        threading.Thread(target=lambda: _post_update(caller, _update_info(named, torch.float32, None)),
                         daemon=True).start()
    else:
        print("group formed", flush=True)
    sent, total = send_some_buckets(WeightSender(client.weights.group, bucket_bytes=BUCKET_BYTES), named,
                                    STOP_BEFORE[where])
    print(f"sent {sent} of {total} buckets", flush=True)
    if how == "exit":
        os._exit(1)
    time.sleep(600)


def _post_update(client: RolloutClient, info: dict) -> None:
    try:
        client.update_weights(info)
    except Exception as e:  # noqa: BLE001 - the test reads the server's state, not this
        print(f"update_weights: {e}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:7])
