"""The RL frameworks' own route dialects, each a thin translation onto the one engine API (no
second pause, push, abort or sleep): SGLang's names for slime and AReaL (sglang.py), vLLM's RL
extras for SkyRL and prime-rl (vllm_rl.py), and `trl vllm-serve`'s older routes (trl.py). Our
routes and vLLM's own names live in rollout/api/. Where a dialect reuses one of our route names
with another body (/generate, /update_weights, /update_weights_from_disk) the route tells them
apart by the body's fields (rollout/api/dispatch.py)."""
from rollout.compat import sglang, trl, vllm_rl

DIALECTS = (sglang, vllm_rl, trl)
