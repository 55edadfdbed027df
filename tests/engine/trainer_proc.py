"""A real trainer process for weight-push tests: rank 0 of a gloo group with the engine.

    python -m tests.engine.trainer_proc PORT MODE [WORLD_SIZE [SEED [DTYPE]]]

It perturbs every parameter of the default model (tests.engine.perturb, with SEED), pushes them with
WeightSender (cast to DTYPE when given), and prints one JSON line: {"ok": ..., "error": ...,
"checksum": ...}.
MODE: full | subset | wrong_shape | unknown_name | wrong_dtype | die (after the first bucket) | late
(a full push LATE_S after the group formed: the engine waits on its receive meanwhile).
"""
import json
import os
import sys
import time

import torch

from engine.default_model import default_model_path
from tests.engine.perturb import perturbed_state
from tests.weight_sync.partial_push import send_first_bucket_only
from weight_sync import WeightSender, WeightTransferGroup, weights_checksum

LATE_S = 2.0


def main(port: int, mode: str, world_size: int, seed: int, dtype: str | None) -> None:
    state = perturbed_state(str(default_model_path()), seed=seed)
    if mode == "subset":
        state = {"model.norm.weight": state["model.norm.weight"],
                 "model.layers.3.mlp.down_proj.weight": state["model.layers.3.mlp.down_proj.weight"]}
    elif mode == "wrong_shape":
        state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:-1]
    elif mode == "unknown_name":
        state["model.layers.99.mlp.up_proj.weight"] = torch.zeros(4, 4)
    elif mode == "wrong_dtype":
        state["model.norm.weight"] = state["model.norm.weight"].to(torch.bfloat16)
    group = WeightTransferGroup("127.0.0.1", port, 0, world_size, timeout_s=20)
    sender = WeightSender(group, bucket_bytes=32 << 20)
    if mode == "die":  # header, verdict, one bucket, then the trainer dies mid-push
        send_first_bucket_only(sender, state.items())
        os._exit(1)
    result = {"checksum": weights_checksum(state.items())}
    if mode == "late":
        time.sleep(LATE_S)
    try:
        result["stats"] = sender.send(state.items(), dtype=dtype and getattr(torch, dtype))  # (DTYPE: all cast)
        result["ok"] = True
    except Exception as e:  # the engine refused: report it
        result.update(ok=False, error=str(e))
    print(json.dumps(result), flush=True)
    group.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 2,
         int(sys.argv[4]) if len(sys.argv) > 4 else 0, sys.argv[5] if len(sys.argv) > 5 else None)
