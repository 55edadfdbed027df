"""The `rollout` command.

    rollout generate "some prompt" [--model DIR] [--max-tokens N] [--temperature T] [--chat]
    rollout serve [MODEL] [--host 127.0.0.1] [--port 8000] [--dtype auto] [--api-key KEY] ...
    rollout dashboard RUN_DIR... [--out DIR]   (server + trainer series of offline runs: PNG + HTML)
"""
import argparse
import re
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
    _add_serve_parser(sub)
    d = sub.add_parser("dashboard", help="draw the server's and the trainer's series of offline runs (PNG + HTML)")
    d.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="a recipe's run folder, a wandb/ folder, or an offline-run-* folder")
    d.add_argument("--out", default=None, help="where to write dashboard.png / .html (default: the first RUN_DIR)")
    args = ap.parse_args(argv)
    if args.command == "dashboard":
        return _dashboard(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    return 2


def _add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible + RL control routes)")
    s.add_argument("model", nargs="?", default=None, help="local Hugging Face folder (default: SmolLM2-135M-Instruct)")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0 = any free port; the ready line shows it)")
    s.add_argument("--served-model-name", default=None, help="model name in /v1 responses (default: folder name)")
    s.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    s.add_argument("--device", default="auto")
    s.add_argument("--max-model-len", type=int, default=None)
    s.add_argument("--max-num-seqs", type=int, default=256)
    s.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (prefill chunks + decodes); default 1024 on CPU, 2048 on CUDA")
    s.add_argument("--kv-cache-memory", type=_bytes, default=None,
                   help="KV cache size, e.g. 2GiB or 512MiB (CPU default 2GiB: its pages are committed as blocks are "
                        "first used, so RSS climbs towards it and stays)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders)")
    s.add_argument("--max-loras", type=int, default=4, help="LoRA adapters resident at once (LRU eviction)")
    s.add_argument("--max-lora-rank", type=int, default=16)
    s.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters loaded at start, served under these model names (implies --enable-lora)")
    s.add_argument("--log-stats-interval-s", type=float, default=None,
                   help="log one engine stats line this often (throughput, queue, KV usage, prefix hits; "
                        "shown with --log-level info)")
    s.add_argument("--engine-stall-timeout-s", type=float, default=600.0,
                   help="/health is 503 when every engine core sent no heartbeat, or sat in one step or call, "
                        "this long (a hung collective or push)")
    s.add_argument("--encoder-cache-size", type=int, default=16384,
                   help="vision-language models: image embeddings (placeholder tokens) the encoder cache holds")
    s.add_argument("--profiler-dir", default=None,
                   help="enables /start_profile and /stop_profile: torch-profiler traces of the engine core go here")
    s.add_argument("--batch-invariant", action="store_true",
                   help="a token's logprobs do not depend on the batch, bit for bit (float32 on CPU; a trainer "
                        "recomputes the same bits with engine.model.batch_invariant.InvariantScorer)")
    s.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per engine core (default: the cores split between replicas)")
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core replicas, each with its own scheduler, KV cache and worker")
    s.add_argument("--max-data-parallel-size", type=int, default=None,
                   help="the most replicas start-up or /scale may ask for (default: one per --num-threads "
                        "cores, or per GPU); /scale still refuses what memory cannot hold")
    s.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                   help="replicas as local processes (mp) or Ray actors (ray: any node of a Ray cluster)")
    s.add_argument("--stay-up-when-engine-dies", action="store_true",
                   help="answer 503 once no engine replica lives instead of exiting with status 1")
    s.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="API-server processes sharing the listening socket, each a client of every replica")
    s.add_argument("--worker-extension-cls", default=None, help="module.Class mixed into the engine's workers")
    s.add_argument("--api-key", default=None,
                   help="Bearer key for every route but /health (env ROLLOUT_API_KEY); admin routes need "
                        "--admin-api-key once any key is set")
    s.add_argument("--admin-api-key", default=None,
                   help="Bearer key for control and weight routes, also accepted by the others "
                        "(env ROLLOUT_ADMIN_API_KEY)")
    s.add_argument("--max-body-bytes", type=_bytes, default=16 << 20, help="larger bodies get 413 (default 16MiB)")
    s.add_argument("--max-encode-inputs", type=int, default=2048,
                   help="inputs one /v1/embeddings, /pooling or /classify call may carry; more is a 400 "
                        "(default 2048, as OpenAI's embeddings API)")
    s.add_argument("--max-request-tokens", type=int, default=1 << 21,
                   help="tokens one generation request may ask to sample, prompts x n x max_tokens (unset "
                        "max_tokens: the context's room); more is a 400 (default 2097152)")
    s.add_argument("--collective-rpc-method", action="append", default=[], metavar="NAME",
                   help="allow /collective_rpc to call this worker method (repeatable)")
    s.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds in-flight requests get before they are aborted")
    s.add_argument("--session-timeout-s", type=float, default=600.0,
                   help="close multi-turn sessions idle this long, freeing their KV (default 600)")
    s.add_argument("--max-sessions", type=int, default=4096, help="open sessions beyond this get 429")
    s.add_argument("--stats-interval-s", type=float, default=1.0)
    s.add_argument("--wandb-project", default=None, help="log metrics to this W&B project (offline without a key)")
    s.add_argument("--wandb-run-name", default=None)
    s.add_argument("--wandb-interval-s", type=float, default=5.0)
    s.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _name_path(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise SystemExit(f"--lora-modules takes NAME=PATH, got {text!r}")
    return name, path


def _bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]i?[bB]?|[bB])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1000000)")
    unit = (m.group(2) or "b").lower().rstrip("b").rstrip("i")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def _serve(args) -> int:
    from rollout.config import ServerConfig
    from rollout.server import run_server

    engine_kwargs = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                         enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                         num_threads=args.num_threads, worker_extension_cls=args.worker_extension_cls,
                         data_parallel_size=args.data_parallel_size,
                         max_data_parallel_size=args.max_data_parallel_size,
                         data_parallel_backend=args.data_parallel_backend, batch_invariant=args.batch_invariant,
                         profiler_dir=args.profiler_dir, log_stats_interval_s=args.log_stats_interval_s,
                         enable_lora=args.enable_lora or bool(args.lora_modules), max_loras=args.max_loras,
                         max_lora_rank=args.max_lora_rank, engine_stall_timeout_s=args.engine_stall_timeout_s,
                         encoder_cache_size=args.encoder_cache_size)
    try:
        config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                              api_key=args.api_key, admin_api_key=args.admin_api_key,
                              max_body_bytes=args.max_body_bytes, max_encode_inputs=args.max_encode_inputs,
                              max_request_tokens=args.max_request_tokens,
                              collective_rpc_methods=tuple(args.collective_rpc_method),
                              stats_interval_s=args.stats_interval_s, shutdown_grace_s=args.shutdown_grace_s,
                              wandb_project=args.wandb_project, wandb_run_name=args.wandb_run_name,
                              wandb_interval_s=args.wandb_interval_s, log_level=args.log_level,
                              engine_kwargs=engine_kwargs, model=args.model, api_server_count=args.api_server_count,
                              exit_on_engine_death=not args.stay_up_when_engine_dies,
                              session_timeout_s=args.session_timeout_s, max_sessions=args.max_sessions,
                              lora_modules=tuple(_name_path(m) for m in args.lora_modules))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return run_server(config)


def _dashboard(args) -> int:
    from pathlib import Path

    from rollout.dashboard import render

    try:
        png, page = render(args.run_dirs, Path(args.out or args.run_dirs[0]))
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"[rollout] wrote {png} and {page}")
    return 0


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
