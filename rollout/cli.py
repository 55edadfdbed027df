"""The `rollout` command.

    rollout generate "some prompt" [--model DIR] [--max-tokens N] [--temperature T] [--raw]
    rollout serve [MODEL | --model MODEL] [--host 127.0.0.1] [--port 8000] [--dtype auto] [--api-key KEY] ...
    rollout dashboard RUN_DIR... [--out DIR]   (server + trainer series of offline runs: PNG + HTML)

Flag names follow `vllm serve` where the meaning is the same (`serve MODEL` positional or `--model`,
`--max-model-len`, `--gpu-memory-utilization`, `--data-parallel-size` ...). Every parser refuses
abbreviated flags (`--dtyp`), and a wrong flag is reported with its subcommand's usage.
"""
import argparse
import re
import sys
import time

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help; a flag whose default is None says in its own help
    what unset means, and an on/off switch (default False) needs no default shown."""

    def _get_help_string(self, action):
        quiet = action.default is None or action.default is False or action.default == []
        if quiet or action.default is argparse.SUPPRESS or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _parser(sub, name: str, help: str, description: str | None = None, usage: str | None = None):
    return sub.add_parser(name, help=help, description=description or help, usage=usage, allow_abbrev=False,
                          formatter_class=HelpFormatter)


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its subcommands' parsers, by name."""
    ap = argparse.ArgumentParser(prog="rollout", description="RL rollout service and inference engine",
                                 allow_abbrev=False, formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True, metavar="{generate,serve,dashboard}")
    commands = {"generate": _add_generate_parser(sub), "serve": _add_serve_parser(sub),
                "dashboard": _add_dashboard_parser(sub)}
    return ap, commands


def main(argv=None) -> int:
    ap, commands = build_parser()
    args, unknown = ap.parse_known_args(argv)
    parser = commands[args.command]
    if unknown:  # reported by the subcommand's parser, with its usage, not the top level's
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "dashboard":
        return _dashboard(args)
    if args.command == "generate":
        return _generate(args)
    _resolve_model(parser, args)
    return _serve(args)


# ---- generate and dashboard ------------------------------------------------------------------------
def _add_generate_parser(sub) -> argparse.ArgumentParser:
    g = _parser(sub, "generate", "generate a completion for one prompt (offline engine, no server)")
    g.add_argument("prompt", help="the user message (or, with --raw, the text to complete)")
    g.add_argument("--model", default=None, help=f"local Hugging Face folder (default: {DEFAULT_MODEL})")
    g.add_argument("--raw", action="store_true", help="complete the raw text instead of a chat turn")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens to sample at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability mass")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = all)")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    _add_dtype_device(g)
    return g


def _add_dashboard_parser(sub) -> argparse.ArgumentParser:
    d = _parser(sub, "dashboard", "draw the server's and the trainer's series of offline runs (PNG + HTML)")
    d.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                   help="a recipe's run folder, a wandb/ folder, or an offline-run-* folder")
    d.add_argument("--out", default=None, help="where to write dashboard.png / .html (default: the first RUN_DIR)")
    return d


def _add_dtype_device(group) -> None:
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and KV cache; auto = bfloat16 on GPU and on CPUs with fast bf16 matmuls "
                            "(AMX, AVX-512, AVX2 + FMA with the C++ kernels built), float32 otherwise")
    group.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")


# ---- serve: its flags in sections, as `rollout serve --help` shows them ----------------------------
def _add_serve_parser(sub) -> argparse.ArgumentParser:
    s = _parser(sub, "serve", "serve a model over HTTP (OpenAI-compatible + RL control routes)",
                description="Serve a model over HTTP: the OpenAI-compatible routes (/v1/...), /generate, "
                            "sessions, weight pushes and pause/resume for a trainer. Stop it with Ctrl-C.",
                usage="%(prog)s [MODEL] [options]")
    s.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"local Hugging Face folder (default: {DEFAULT_MODEL}); same as --model")
    _add_model_args(s.add_argument_group("model"))
    _add_engine_args(s.add_argument_group("engine: memory and scheduling"))
    _add_lora_args(s.add_argument_group("LoRA adapters"))
    _add_scale_out_args(s.add_argument_group("scale-out: engine replicas and API servers"))
    _add_http_args(s.add_argument_group("HTTP server: address, keys and limits"))
    _add_observability_args(s.add_argument_group("logs, metrics and profiling"))
    return s


def _add_model_args(group) -> None:
    group.add_argument("--model", default=None,
                       help=f"the positional MODEL as a flag, as `vllm serve` takes both (default: {DEFAULT_MODEL})")
    group.add_argument("--served-model-name", default=None,
                       help="model name in /v1 requests and responses (default: the folder's name)")
    _add_dtype_device(group)
    group.add_argument("--seed", type=int, default=0,
                       help="seeds the engine's sampler for requests that bring no seed of their own")
    group.add_argument("--enable-return-routed-experts", action="store_true",
                       help="mixture-of-experts models: keep each token's chosen experts, so that requests may ask "
                            "return_routed_experts (routing replay in the trainer)")
    group.add_argument("--batch-invariant", action="store_true",
                       help="a token's logprobs do not depend on the batch, bit for bit (float32 on CPU; a trainer "
                            "recomputes the same bits with engine.model.batch_invariant.InvariantScorer)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="every step op by op: no CUDA graphs for decode steps, and on a CPU no C++ layer "
                            "loop (the same results)")
    group.add_argument("--async-scheduling", action="store_true",
                       help="schedule the next step while this one runs (the host's share of a step overlaps the "
                            "forward pass: for short GPU steps; not with expert parallelism)")
    group.add_argument("--worker-extension-cls", default=None,
                       help="module.Class mixed into the engine's workers (default: none)")


def _add_engine_args(group) -> None:
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest sequence, prompt + output, in tokens (default: the model's "
                            "max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="requests running in one step at most")
    group.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="token budget of one step, prefill chunks + decodes (default: 1024 on CPU, 2048 on CUDA)")
    group.add_argument("--kv-cache-memory", type=_bytes, default=None,
                       help="KV cache size, e.g. 2GiB or 512MiB (default: 2GiB on CPU, its pages committed as blocks "
                            "are first used; on CUDA what --gpu-memory-utilization leaves after the weights)")
    group.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto",
                       help="auto: the model's dtype; int8: 8-bit keys and values with a scale per token and kv "
                            "head, ~2x the tokens in the same memory and a faster decode, logprobs drift slightly "
                            "(CPU only)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="CUDA only: the fraction of the GPU's memory the engine may use (weights, activations, "
                            "KV cache)")
    group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn off prefix caching (on by default: requests sharing a prompt prefix reuse its KV)")
    group.add_argument("--num-threads", type=int, default=None,
                       help="torch threads per engine core (default: torch's choice; with -dp > 1 on CPU the cores "
                            "split between replicas)")
    group.add_argument("--encoder-cache-size", type=int, default=16384,
                       help="vision-language models: image embeddings (placeholder tokens) the encoder cache holds")
    group.add_argument("--engine-stall-timeout-s", type=float, default=600.0,
                       help="/health is 503 when every engine core sent no heartbeat, or sat in one step or call, "
                            "this long (a hung collective or push)")


def _add_lora_args(group) -> None:
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders)")
    group.add_argument("--max-loras", type=int, default=4, help="LoRA adapters resident at once (LRU eviction)")
    group.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank accepted")
    group.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters loaded at start, served under these model names (implies --enable-lora; "
                            "default: none)")


def _add_scale_out_args(group) -> None:
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine-core replicas, each with its own scheduler, KV cache and worker(s)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="worker ranks per replica, each holding a shard of the model and of the KV cache "
                            "(a model larger than one device)")
    group.add_argument("--max-data-parallel-size", type=int, default=None,
                       help="the most replicas start-up or /scale may ask for (default: one per --num-threads cores, "
                            "or per GPU); /scale still refuses what memory cannot hold")
    group.add_argument("--data-parallel-backend", default="mp", choices=["mp", "ray"],
                       help="replicas as local processes (mp) or Ray actors (ray: any node of a Ray cluster)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="mixture-of-experts models: split each layer's experts between the replicas (-dp), "
                            "tokens sent to their experts by all-to-all; the replicas step in lockstep")
    group.add_argument("--api-server-count", "-asc", type=int, default=1,
                       help="API-server processes sharing the listening socket, each a client of every replica")
    group.add_argument("--stay-up-when-engine-dies", action="store_true",
                       help="answer 503 once no engine replica lives instead of exiting with status 1")


def _add_http_args(group) -> None:
    group.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    group.add_argument("--port", type=int, default=8000, help="port (0 = any free port; the ready line shows it)")
    group.add_argument("--api-key", default=None,
                       help="Bearer key for every route but /health (default: env ROLLOUT_API_KEY, else none); "
                            "admin routes need --admin-api-key once any key is set")
    group.add_argument("--admin-api-key", default=None,
                       help="Bearer key for control and weight routes, also accepted by the others "
                            "(default: env ROLLOUT_ADMIN_API_KEY, else none)")
    group.add_argument("--max-body-bytes", type=_bytes, default=16 << 20,
                       help="larger request bodies get 413; sizes as for --kv-cache-memory (default: 16MiB)")
    group.add_argument("--max-encode-inputs", type=int, default=2048,
                       help="inputs one /v1/embeddings, /pooling or /classify call may carry; more is a 400 "
                            "(OpenAI's embeddings API has the same cap)")
    group.add_argument("--max-request-tokens", type=int, default=1 << 21,
                       help="tokens one generation request may ask to sample, prompts x n x max_tokens (unset "
                            "max_tokens: the context's room); more is a 400")
    group.add_argument("--max-sessions", type=int, default=4096, help="open multi-turn sessions beyond this get 429")
    group.add_argument("--session-timeout-s", type=float, default=600.0,
                       help="close multi-turn sessions idle this long, freeing their KV")
    group.add_argument("--collective-rpc-method", action="append", default=[], metavar="NAME",
                       help="allow /collective_rpc to call this worker method (repeatable; default: none)")
    group.add_argument("--apply-model-fn", action="append", default=[], metavar="PATH",
                       help="allow /apply_model to run this function on the workers' models, by import path "
                            "'package.module:function' (repeatable; default: none)")
    group.add_argument("--min-weight-version", type=_non_negative_int, default=0,
                       help="GET /ready answers 503 until every replica holds at least this weight version (a server "
                            "restarted mid-run: the version the trainer last pushed; default 0)")
    group.add_argument("--shutdown-grace-s", type=float, default=5.0,
                       help="on SIGINT/SIGTERM, seconds in-flight requests get before they are aborted")


def _add_observability_args(group) -> None:
    group.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                       help="the server's log level")
    group.add_argument("--disable-log-requests", action="store_true",
                       help="log only failed requests, not one line per request (pauses and pushes are logged "
                            "either way)")
    group.add_argument("--stats-interval-s", type=float, default=1.0,
                       help="how often the server polls the engine's stats for /metrics and W&B (queue, KV usage, "
                            "weight version; the tokens/s gauge is the rate between two polls)")
    group.add_argument("--log-stats-interval-s", type=float, default=None,
                       help="log one engine stats line to the console this often (throughput, queue, KV usage, "
                            "prefix hits; shown with --log-level info; default: never)")
    group.add_argument("--wandb-project", default=None,
                       help="log the /metrics series to this W&B project (offline without an API key; default: off)")
    group.add_argument("--wandb-run-name", default=None, help="the W&B run's name (default: W&B picks one)")
    group.add_argument("--wandb-interval-s", type=float, default=5.0, help="seconds between two W&B rows")
    group.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                       help="export one OpenTelemetry span per finished request (vLLM's attributes) to this OTLP "
                            "HTTP/protobuf collector, e.g. http://localhost:4318/v1/traces; a request's traceparent "
                            "header is its parent (needs `pip install 'rollout[tracing]'`; default: off)")
    group.add_argument("--profiler-dir", default=None,
                       help="enables /start_profile and /stop_profile: torch-profiler traces of the engine core go "
                            "here (default: profiling off)")


def _resolve_model(parser: argparse.ArgumentParser, args) -> None:
    """`serve MODEL` and `serve --model MODEL` are the same; both, if they differ, is an error."""
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        parser.error(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag if args.model_tag is not None else args.model


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


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _serve(args) -> int:
    from rollout.config import ServerConfig
    from rollout.server import run_server

    engine_kwargs = dict(dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                         max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                         kv_cache_memory=args.kv_cache_memory, kv_cache_dtype=args.kv_cache_dtype,
                         gpu_memory_utilization=args.gpu_memory_utilization,
                         enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
                         num_threads=args.num_threads, worker_extension_cls=args.worker_extension_cls,
                         data_parallel_size=args.data_parallel_size, tensor_parallel_size=args.tensor_parallel_size,
                         max_data_parallel_size=args.max_data_parallel_size,
                         data_parallel_backend=args.data_parallel_backend, batch_invariant=args.batch_invariant,
                         enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling,
                         profiler_dir=args.profiler_dir,
                         log_stats_interval_s=args.log_stats_interval_s,
                         enable_lora=args.enable_lora or bool(args.lora_modules), max_loras=args.max_loras,
                         max_lora_rank=args.max_lora_rank, engine_stall_timeout_s=args.engine_stall_timeout_s,
                         encoder_cache_size=args.encoder_cache_size, otlp_traces_endpoint=args.otlp_traces_endpoint,
                         enable_expert_parallel=args.enable_expert_parallel,
                         enable_return_routed_experts=args.enable_return_routed_experts)
    if args.otlp_traces_endpoint:  # before the model loads: a missing SDK is a start-up error
        from engine.frontend.tracing import check_otlp_endpoint

        try:
            check_otlp_endpoint(args.otlp_traces_endpoint)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    try:
        config = ServerConfig(host=args.host, port=args.port, served_model_name=args.served_model_name,
                              api_key=args.api_key, admin_api_key=args.admin_api_key,
                              max_body_bytes=args.max_body_bytes, max_encode_inputs=args.max_encode_inputs,
                              max_request_tokens=args.max_request_tokens,
                              collective_rpc_methods=tuple(args.collective_rpc_method),
                              apply_model_fns=tuple(args.apply_model_fn),
                              stats_interval_s=args.stats_interval_s, shutdown_grace_s=args.shutdown_grace_s,
                              wandb_project=args.wandb_project, wandb_run_name=args.wandb_run_name,
                              wandb_interval_s=args.wandb_interval_s, log_level=args.log_level,
                              engine_kwargs=engine_kwargs, model=args.model, api_server_count=args.api_server_count,
                              exit_on_engine_death=not args.stay_up_when_engine_dies,
                              session_timeout_s=args.session_timeout_s, max_sessions=args.max_sessions,
                              lora_modules=tuple(_name_path(m) for m in args.lora_modules),
                              log_requests=not args.disable_log_requests,
                              min_weight_version=args.min_weight_version)
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
