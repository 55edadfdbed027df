"""A trainer that fails mid-push, for tests of the receivers' side."""
import torch

from weight_sync import WeightSender
from weight_sync.protocol import _pack, plan_buckets


def send_first_bucket_only(sender: WeightSender, named_tensors) -> None:
    """Start a push as WeightSender.send does (header, verdict, first bucket) and stop there; the
    caller then dies or hangs, leaving the receivers waiting for the other buckets."""
    tensors, header = sender._collect(named_tensors, None)
    sender._send_header(header)
    sender.group.all_reduce_max(0)
    first = plan_buckets(header)[0]
    buf = torch.empty(first.nbytes, dtype=torch.uint8)
    _pack(tensors, first, buf)
    sender.group.broadcast(buf)
