"""The throughput workload, shared by benchmarks/throughput.py (our engines, transformers in
process) and benchmarks/peers.py (peer engines in their own venvs). Standard library only, so a
peer's venv imports it without this repository's packages.

32 short user questions through the model's chat template, 128 new tokens each, EOS ignored, so
every engine generates exactly 32 x 128 tokens per batch; greedy and temperature 1.0 (top-p 1,
top-k off); batch b > 32 repeats the questions; single-stream decode tok/s is
127 / (T(128 tokens) - T(1 token)), which leaves the prompt's prefill out.

    run(prompts, sample, n) -> (seconds, [generated token ids per prompt])
    res = measure(tok, run, batches=[1, 32], reps=2, load_s=load_s)
"""
import resource
import sys
import time

QUESTIONS = [
    "What is 17 + 25?", "What is 9 times 8?", "What is the capital of France?",
    "Who wrote Romeo and Juliet?", "What is 144 divided by 12?", "Name three primary colors.",
    "What is the boiling point of water in Celsius?", "How many legs does a spider have?",
    "What is 15% of 200?", "Which planet is known as the Red Planet?",
    "What is the square root of 81?", "Who painted the Mona Lisa?", "What is 1000 minus 357?",
    "What gas do plants absorb from the air?", "How many days are in a leap year?",
    "What is the largest ocean on Earth?",
    "If I have 3 apples and buy 5 more, how many do I have?",
    "What is the chemical symbol for gold?", "What is 7 cubed?", "In which continent is Kenya?",
    "What is the freezing point of water in Fahrenheit?",
    "Who was the first person to walk on the Moon?", "What is 2 to the power of 10?",
    "What language is spoken in Brazil?",
    "A train travels 60 km in 1.5 hours. What is its speed?",
    "What is the tallest mountain in the world?", "What is 48 divided by 6, plus 3?",
    "How many continents are there?", "What is the smallest prime number?",
    "Who discovered penicillin?", "What is 12 squared minus 44?",
    "What is the main ingredient of guacamole?",
]
assert len(QUESTIONS) == 32, len(QUESTIONS)
MAX_NEW = 128
SINGLE_Q = "Explain briefly why the sky is blue."


def prompt_texts(tok, questions=QUESTIONS) -> list[str]:
    """Chat-templated prompt strings (add_generation_prompt=True) from a Hugging Face tokenizer."""
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in questions]


def measure(tok, run, batches, reps: int, load_s: float) -> dict:
    """Time the workload: {"b<B>_greedy_tok_s", "b<B>_sample_tok_s" (best of `reps`; one run
    above batch 32), "single_decode_tok_s", "peak_rss_mb" (this process), "load_s"}."""
    res = {"load_s": load_s}
    run(prompt_texts(tok, QUESTIONS[:4]), True, 8)  # warm-up
    for b in batches:
        if b == 1:
            continue
        prompts = prompt_texts(tok, (QUESTIONS * (b // len(QUESTIONS) + 1))[:b])
        for mode in ("greedy", "sample"):
            times = []
            for _ in range(reps if b <= 32 else 1):
                seconds, outs = run(prompts, mode == "sample", MAX_NEW)
                assert len(outs) == b and all(len(o) == MAX_NEW for o in outs), [len(o) for o in outs]
                times.append(seconds)
            res[f"b{b}_{mode}_tok_s"] = b * MAX_NEW / min(times)
            log(f"  batch {b} {mode}: {res[f'b{b}_{mode}_tok_s']:.0f} tok/s")
    if 1 in batches:
        single = prompt_texts(tok, [SINGLE_Q])
        t1 = min(run(single, False, 1)[0] for _ in range(3))
        t128 = min(run(single, False, MAX_NEW)[0] for _ in range(reps))
        res["single_decode_tok_s"] = (MAX_NEW - 1) / (t128 - t1)
        log(f"  single-stream decode: {res['single_decode_tok_s']:.1f} tok/s")
    res["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
