"""Moving weights trainer -> engine, both sides. Knows nothing about the engine's internals.

Data flow of one update (the trainer drives it; the engine's worker is the receiver):

    pause generation -> WeightSender.send(named_tensors)  ==gloo/NCCL==>  WeightReceiver.receive(expected)
    -> engine swaps the staged tensors in atomically -> clear prefix/encoder caches
    -> bump weight version -> resume;  weights_checksum() on both sides verifies the push.

Group: `WeightTransferGroup` is a stateless torch.distributed group (never the default group):
rank 0 = trainer hosts a TCPStore rendezvous, ranks 1..N = engine workers; gloo on CPU, NCCL on
CUDA, same calls. Every collective has a timeout: a dead or hung peer becomes
`WeightTransferError`, never a hang; `with group.deadline(s):` bounds a whole push as well
(`WeightDeadlineError`).

Protocol (protocol.py), one call per update: header (msgpack list of name, dtype, shape) ->
all-reduce of the receivers' verdict (names/shapes/dtypes checked, a refusal stops everyone
before any tensor moves) -> size-capped dtype-homogeneous buckets -> all-reduce confirming
every receiver has everything. The receiver stages into fresh tensors and returns them only
when complete, so a failed push leaves the live weights whole.

Other routes: `load_safetensors_folder()` reads a (sharded) checkpoint from disk;
`SharedWeights` / `read_shared` (ipc.py) hand tensors to an engine on the same machine (CUDA
IPC on a shared GPU, shared memory on CPU).
"""
from weight_sync.checkpoint import load_safetensors_folder
from weight_sync.checksum import weights_checksum
from weight_sync.group import (WeightDeadlineError, WeightGroupError, WeightPushRefused, WeightTransferError,
                               WeightTransferGroup, find_free_port)
from weight_sync.ipc import SharedWeights, SpareWriter, host_key, read_shared
from weight_sync.names import checkpoint_named
from weight_sync.protocol import DEFAULT_BUCKET_BYTES, WeightReceiver, WeightSender

__all__ = [
    "checkpoint_named",
    "DEFAULT_BUCKET_BYTES",
    "SharedWeights",
    "SpareWriter",
    "WeightReceiver",
    "WeightDeadlineError",
    "WeightGroupError",
    "WeightPushRefused",
    "WeightSender",
    "WeightTransferError",
    "WeightTransferGroup",
    "find_free_port",
    "host_key",
    "load_safetensors_folder",
    "read_shared",
    "weights_checksum",
]
