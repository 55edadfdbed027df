"""What the C++ decode layer loop buys (engine/model/decoder.py's DecodePlan): one engine, the
default model, its all-decode steps run through the plan and op by op from Python (what
enforce_eager runs) in alternating rounds, so both sides see the same host; decode tok/s of each
round (128 new tokens, EOS ignored, greedy, minus the time of a 1-token run of the same prompts),
median and best per side, and the outputs compared (the plan must give the same tokens).

    .venv/bin/python benchmarks/decode_plan.py [--dtypes bfloat16,float32] [--batches 1,32] [--rounds 6]

The host's noise on a 2-core VM is as large as the difference at batch 32: read the medians of
one run, over several rounds.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

from timing import machine_line  # noqa: E402  (benchmarks/timing.py)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from workload import QUESTIONS, SINGLE_Q, prompt_texts

    print(machine_line())
    rows = []
    for dtype in args.dtypes.split(","):
        llm = LLM(dtype=dtype, multiprocess=False, enable_prefix_caching=False, max_num_seqs=256,
                  max_num_batched_tokens=4096)
        model = llm.client.core.executor.worker.model

        def timed(prompts, n):
            sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
            t = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            return time.perf_counter() - t, [o.outputs[0].token_ids for o in outs]

        for b in (int(x) for x in args.batches.split(",")):
            prompts = prompt_texts(llm.tokenizer, [SINGLE_Q] if b == 1 else (QUESTIONS * (b // len(QUESTIONS) + 1))[:b])
            timed(prompts, 8)  # warm-up
            rates, tokens = {True: [], False: []}, {}
            for r in range(args.rounds):
                for plan in (False, True) if r % 2 == 0 else (True, False):
                    model.use_decode_plan = plan
                    t1 = timed(prompts, 1)[0]
                    t, out = timed(prompts, args.tokens)
                    rates[plan].append(b * (args.tokens - 1) / (t - t1))
                    assert tokens.setdefault(plan, out) == out
            assert model._plan is not None, "the plan never ran"
            same = "yes" if tokens[True] == tokens[False] else "NO"
            med = {p: statistics.median(v) for p, v in rates.items()}
            rows.append((dtype, b, med[False], max(rates[False]), med[True], max(rates[True]), med[True] / med[False],
                         same))
            print(f"  {dtype} batch {b}: op by op {' '.join(f'{x:.1f}' for x in rates[False])}; "
                  f"plan {' '.join(f'{x:.1f}' for x in rates[True])}", file=sys.stderr, flush=True)
        llm.shutdown()
    print(f"decode tok/s over {args.rounds} alternating rounds (median / best)")
    print("| dtype | batch | op by op | plan | plan / op by op (medians) | same tokens |")
    print("|---|--:|--:|--:|--:|---|")
    for dtype, b, m0, b0, m1, b1, ratio, same in rows:
        print(f"| {dtype} | {b} | {m0:.1f} / {b0:.1f} | {m1:.1f} / {b1:.1f} | {ratio:.2f}x | {same} |")


if __name__ == "__main__":
    main()
