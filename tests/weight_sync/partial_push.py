"""A trainer that fails mid-push, for tests of the receivers' side."""
import time

import torch

from weight_sync import WeightSender
from weight_sync.protocol import _pack, plan_buckets


def send_some_buckets(sender: WeightSender, named_tensors, how_many, pause_s: float = 0.0,
                      dtype=None) -> tuple[int, int]:
    """Start a push as WeightSender.send does (header, verdict) and send the first
    `how_many(number of buckets)` buckets, then stop; the caller then dies or hangs, leaving the
    receivers waiting for the rest. `pause_s`: a slow trainer, sleeping before every bucket.
    `dtype`: the wire dtype of floating-point tensors (as WeightSender.send's). Returns (buckets
    sent, buckets in the push)."""
    tensors, header = sender._collect(named_tensors, dtype)
    sender._send_header(header)
    sender.group.all_reduce_max(0)
    buckets = [b for b in plan_buckets(header) if b.nbytes]
    count = how_many(len(buckets))
    for b in buckets[:count]:
        time.sleep(pause_s)
        buf = torch.empty(b.nbytes, dtype=torch.uint8)
        _pack(tensors, b, buf)
        sender.group.broadcast(buf)
    return count, len(buckets)


def send_first_bucket_only(sender: WeightSender, named_tensors) -> None:
    send_some_buckets(sender, named_tensors, lambda n: 1)
