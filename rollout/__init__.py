"""The rollout service: HTTP server, `rollout` CLI, trainer client, metrics.

    trainer: RolloutClient (client.py, client_weights.py) --HTTP--> server.py (FastAPI app,
    routes in api/) --> engine.AsyncLLM;   trainer: WeightSender ==gloo/NCCL==> engine workers

The server owns no model state: the engine does. It adds what a trainer needs around it: the
OpenAI and /generate routes, vLLM-named RL control routes, API keys, metrics (metrics.py).
"""
from rollout.client import AsyncRolloutClient, GenerateOutput, RolloutClient
from rollout.errors import RolloutAPIError, RolloutConnectionError

__all__ = ["AsyncRolloutClient", "GenerateOutput", "RolloutAPIError", "RolloutClient", "RolloutConnectionError"]
