"""Runs TRL's own VLLMClient (trl.generation.vllm_client, TRL 1.16.0) against a server, in a
process of its own: tests/rollout/test_compat_trl.py starts it with the vllm stub
(tests/rollout/vllm_stub) on PYTHONPATH, so that no other test sees a `vllm` package.

stdin: {"url": ..., "calls": [[name, method, kwargs], ...]}; stdout: one JSON object
{"versions": {...}, "results": {name: the method's return value, or {"error": type, "message"}}}.
"""
import json
import sys


def main() -> None:
    spec = json.load(sys.stdin)
    import trl
    import vllm
    from trl.generation.vllm_client import VLLMClient
    from trl.import_utils import is_vllm_available

    client = VLLMClient(base_url=spec["url"], connection_timeout=30)
    results = {}
    for name, method, kwargs in spec["calls"]:
        try:
            results[name] = getattr(client, method)(**kwargs)
        except Exception as e:  # noqa: BLE001 - the test reads what TRL raised
            results[name] = {"error": type(e).__name__, "message": str(e)}
    versions = {"trl": trl.__version__, "vllm_stub": vllm.__file__, "vllm_available": is_vllm_available(),
                "model": client.model}
    print(json.dumps({"versions": versions, "results": results}))


if __name__ == "__main__":
    main()
