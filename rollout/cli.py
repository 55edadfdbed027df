"""The `rollout` command.

    rollout generate "some prompt" [--model DIR] [--max-tokens N] [--temperature T] [--chat]
"""
import argparse
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="rollout", description="RL rollout service and inference engine")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt (offline engine)")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--raw", action="store_true", help="complete the raw text instead of a chat turn")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--device", default="auto")
    args = ap.parse_args(argv)
    if args.command == "generate":
        return _generate(args)
    return 2


def _generate(args) -> int:
    from engine import LLM, SamplingParams

    t = time.perf_counter()
    print("[rollout] loading the model ...", file=sys.stderr, flush=True)
    try:
        llm = LLM(args.model, dtype=args.dtype, device=args.device)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    c = llm.config
    print(f"[rollout] {c.model_config.architecture} from {c.model} ({c.dtype}, {c.device}) "
          f"ready in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
    t = time.perf_counter()
    if args.raw:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    comp = out.outputs[0]
    el = time.perf_counter() - t
    print(comp.text)
    print(f"[rollout] {len(comp.token_ids)} tokens in {el:.2f} s ({len(comp.token_ids) / el:.1f} tok/s), "
          f"finish_reason={comp.finish_reason}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
