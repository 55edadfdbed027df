"""The HTTP routes, one concern per module: openai.py (/v1/*), generate.py (/generate),
control.py (pause / sleep / caches / abort / collective_rpc), weights.py (weight transfer);
protocol.py holds the request bodies, errors.py the error mapping, state.py what routes share.
"""
