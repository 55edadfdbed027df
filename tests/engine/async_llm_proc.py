"""A stand-alone AsyncLLM user, for the signal tests in test_async_llm.py.

    python tests/engine/async_llm_proc.py

Starts AsyncLLM on the default model, prints `pid <engine-core pid>` and `dirs <its IPC
folders>`, starts one long greedy request, prints `generating` after its first tokens, and
keeps generating until it is killed.
"""
import asyncio
import os
import signal

# A shell starts a background job with SIGINT ignored, and the ignore is inherited: this script
# stands for a program in a terminal's foreground, where Ctrl-C raises KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from engine import SamplingParams
from engine.frontend.async_llm import AsyncLLM


async def main() -> None:
    llm = AsyncLLM(dtype="float32", max_model_len=4096)
    print("pid", llm.client.manager.procs[0].pid, flush=True)
    print("dirs", llm.client._tmpdir, llm.client.manager._tmp, flush=True)  # IPC sockets live there
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    n = 0
    while True:  # until a signal ends this process
        async for _ in llm.generate("Tell me a very long story about a lighthouse keeper.", params):
            n += 1
            if n == 3:
                print("generating", flush=True)


if __name__ == "__main__":
    asyncio.run(main())
