"""The HTTP routes, one concern per module: openai.py (/v1/*), generate.py (/generate),
sessions.py (multi-turn sessions), pooling.py (embeddings, /pooling, /classify), control.py
(pause / sleep / caches / abort / collective_rpc), weights.py (weight transfer); protocol.py
holds the request bodies, errors.py the error mapping, state.py what routes share (with the
session store, session_store.py). Leaves every route may use: cancel.py (until_disconnect,
gather_all), output_json.py (engine outputs as JSON), logprobs_json.py (logprobs as the OpenAI
routes and vLLM answer them), streaming.py (prime, merge, SSE/NDJSON).
state.py, session_store.py and the leaves import no route module.
"""
