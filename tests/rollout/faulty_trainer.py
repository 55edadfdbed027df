"""A trainer that fails in the middle of a push, run as its own process by test_faults.py:

    python -m tests.rollout.faulty_trainer URL ADMIN_KEY {exit|hang} {first|middle|last} MODEL_DIR

It forms the group, pauses, starts an update, posts /update_weights (in a thread, as
WeightTransfer does), sends the header and the buckets before the first, middle or last one of
a push of perturbed weights, and then dies (os._exit) or stops answering (sleeps) where that
bucket should go, leaving the server's receiver waiting for the rest.
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
from weight_sync.protocol import _pack, plan_buckets

BUCKET_BYTES = 64 << 20


def send_until(sender: WeightSender, named: list, where: str) -> str:
    """WeightSender.send's first steps (header, verdict) and the buckets before `where`."""
    tensors, header = sender._collect(named, None)
    sender._send_header(header)
    sender.group.all_reduce_max(0)
    buckets = [b for b in plan_buckets(header) if b.nbytes]
    count = {"first": 0, "middle": len(buckets) // 2, "last": len(buckets) - 1}[where]
    for b in buckets[:count]:
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        _pack(tensors, b, buf)
        sender.group.broadcast(buf)
    return f"sent {count} of {len(buckets)} buckets"


def main(url: str, key: str, how: str, where: str, model_dir: str) -> None:
    client = RolloutClient(url, admin_api_key=key, api_key=key, timeout=120)
    client.init_weight_transfer(backend="gloo", timeout_s=8, bucket_bytes=BUCKET_BYTES)
    named = sorted(perturbed_state(model_dir, seed=7).items())
    client.pause(mode="keep")
    client.start_weight_update()
    caller = RolloutClient(url, admin_api_key=key, api_key=key, timeout=120)
    threading.Thread(target=lambda: _post_update(caller, _update_info(named, torch.float32, None)),
                     daemon=True).start()
    print(send_until(WeightSender(client.weights.group, bucket_bytes=BUCKET_BYTES), named, where), flush=True)
    if how == "exit":
        os._exit(1)
    time.sleep(600)


def _post_update(client: RolloutClient, info: dict) -> None:
    try:
        client.update_weights(info)
    except Exception as e:  # noqa: BLE001 - the test reads the server's state, not this
        print(f"update_weights: {e}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:6])
