"""A real trainer process that shares weights with an engine on the same machine:

    python -m tests.engine.ipc_trainer_proc MODE

It perturbs every parameter of the default model, shares them (weight_sync.SharedWeights:
shared memory here, CUDA IPC with MODE cuda), prints one JSON line {"handles": ..., "checksum": ...},
then keeps the tensors alive until it reads a line on stdin, closes the share and exits.
MODE: full | wrong_shape | unknown_name | cuda | spare (reads the engine's lease as a JSON line
first and writes the tensors into its spare: weight_sync.SpareWriter).
"""
import json
import sys

import torch

from engine.default_model import default_model_path
from tests.engine.perturb import perturbed_state
from weight_sync import SharedWeights, SpareWriter, weights_checksum


def main(mode: str) -> None:
    state = perturbed_state(str(default_model_path()))
    if mode == "wrong_shape":
        state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:-1]
    elif mode == "unknown_name":
        state["model.layers.99.mlp.up_proj.weight"] = torch.zeros(4, 4)
    elif mode == "cuda":
        state = {n: t.cuda() for n, t in state.items()}
    elif mode == "spare":
        writer = SpareWriter()
        handles = writer.write(json.loads(sys.stdin.readline()), state.items())
        writer.close()
        print(json.dumps({"handles": handles, "checksum": weights_checksum(state.items(), torch.float32)}), flush=True)
        sys.stdin.readline()
        return
    with SharedWeights() as shared:
        handles = shared.share(state.items())
        print(json.dumps({"handles": handles, "checksum": weights_checksum(state.items(), torch.float32)}),
              flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    main(sys.argv[1])
