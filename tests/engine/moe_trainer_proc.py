"""A trainer process for expert-parallel push tests: rank 0 of a gloo group with the engine's replicas.

    python -m tests.engine.moe_trainer_proc PORT MODE WORLD_SIZE MODEL_FOLDER OUT_FOLDER

Loads the tiny MoE model with transformers, perturbs every parameter (seeded), pushes its
state_dict() as transformers holds it (experts fused: mlp.experts.gate_up_proj / down_proj), saves
the perturbed model to OUT_FOLDER (the test's reference) and prints one JSON line {"ok", "error",
"checksum"} (the checksum over checkpoint names, weight_sync.checkpoint_named).
MODE: full | wrong_shape (one expert tensor a row short: refused before anything moves).
"""
import json
import sys

import torch
from transformers import AutoModelForCausalLM

from weight_sync import WeightSender, WeightTransferGroup, checkpoint_named, weights_checksum


def main(port: int, mode: str, world_size: int, folder: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    state = dict(model.state_dict())
    if mode == "wrong_shape":
        name = next(n for n in state if n.endswith("mlp.experts.down_proj"))
        state[name] = state[name][:, :-1]
    group = WeightTransferGroup("127.0.0.1", port, 0, world_size, timeout_s=60)
    result = {"checksum": weights_checksum(checkpoint_named(state.items(), model.config.model_type))}
    try:
        result["stats"] = WeightSender(group).send(state.items())
        result["ok"] = True
        model.save_pretrained(out)
    except Exception as e:  # the engine refused: report it
        result.update(ok=False, error=str(e))
    print(json.dumps(result), flush=True)
    group.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
