"""Lazily built C++ CPU kernels (torch.utils.cpp_extension, JIT), and the rules for when
they apply.

`load()` compiles `csrc/paged_attention.cpp`, `csrc/fused_ops.cpp`, `csrc/invariant_ops.cpp`,
`csrc/vnni_linear.cpp`, `csrc/amx_linear.cpp` (the bf16 matmuls, packed once for both),
`csrc/f32_linear.cpp` (float32 arithmetic on packed float32 or bf16 weights: the float32
matmul, and the bf16 one on CPUs without AVX-512 BF16), `csrc/spare_write.cpp` (a trainer's
packs and copies into a leased weight spare, in one call), `csrc/moe.cpp` (kernels/moe.py's experts), `csrc/shm_comm.cpp`
(kernels/shm_comm.py's collectives), `csrc/decode_layers.cpp` (a decode step's decoder layers in
one call: engine/model/decoder.py's DecodePlan) and their bindings (`csrc/bindings.cpp`, the one
PYBIND11_MODULE; `csrc/ops.h` declares every op) into one extension module on first use
(~10-60 s, once per source version) into
`$ROLLOUT_CACHE/torch_extensions/<name>/` (default `~/.cache/rollout/...`) and returns the
module, or None with one warning on the "kernels" logger if it cannot be built (no compiler,
compile error); callers then fall back to pure torch. The module name carries a hash of the
source text, the torch version, the flags and the CPU's feature flags, so an edited source, a
new torch or a cache shared with another CPU model (-march=native) builds a fresh folder
instead of reusing a stale or illegal-instruction .so.

Trap: torch's JIT build runs `ninja` from PATH. The `ninja` PyPI package installs it into the
venv's bin/, which is not on PATH when python is run as `.venv/bin/python` without activating
the venv, so we add the package's BIN_DIR to PATH when needed.

Eligibility, in one place: `ops_for(device, dtype)` is the module when its ops take tensors
of that device and dtype (CPU, float32 / bfloat16), and `supports_head_dim(op, head_dim)` the
head sizes the attention and rotary ops are built for. The per-call dispatchers in kernels/
add only layout checks (contiguity); the model binds the ops once through the same rules.
"""
import functools
import hashlib
import logging
import os
import platform
import shutil
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger("kernels")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / "paged_attention.cpp", _CSRC / "fused_ops.cpp", _CSRC / "invariant_ops.cpp",
            _CSRC / "vnni_linear.cpp", _CSRC / "amx_linear.cpp", _CSRC / "f32_linear.cpp", _CSRC / "spare_write.cpp",
            _CSRC / "moe.cpp", _CSRC / "shm_comm.cpp", _CSRC / "decode_layers.cpp", _CSRC / "bindings.cpp"]
# included by the sources: part of the hash
_HEADERS = [_CSRC / "ops.h", _CSRC / "vec.h", _CSRC / "pack_ahead.h", _CSRC / "bf16_round.h"]
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_STALE_LOCK_S = 600  # a build lock this old was left by a killed build
_lock = threading.Lock()
_module = None
_tried = False


def _cache_dir() -> Path:
    return Path(os.environ.get("ROLLOUT_CACHE") or Path.home() / ".cache" / "rollout")


def _cpu_flags() -> str:
    """The CPU's feature flags: -march=native code must not be reused on another CPU model."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln for ln in f if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor() or platform.machine()


def _module_name() -> str:
    import torch

    h = hashlib.sha256(" ".join([torch.__version__, *_CFLAGS, *_LDFLAGS, _cpu_flags()]).encode())
    for src in _SOURCES + _HEADERS:
        h.update(src.read_bytes())
    return f"rollout_cpu_kernels_{h.hexdigest()[:10]}"


def _ensure_ninja() -> bool:
    if shutil.which("ninja"):
        return True
    try:
        import ninja  # PyPI package; ships the binary in ninja.BIN_DIR
    except ImportError:
        return False
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return shutil.which("ninja") is not None


def _build_dir(name: str) -> Path:
    return _cache_dir() / "torch_extensions" / name


def _import_built(name: str, so: Path):
    """The module of an extension built earlier (its name hashes its sources and flags, so an
    existing library is current), imported directly: torch's loader takes a lock file and runs
    ninja in every process, and a process killed while holding that lock (tests and
    supervisors kill engines at start-up) leaves every later start waiting on it."""
    import importlib.util

    import torch  # noqa: F401 - the library links against libtorch, loaded by importing torch

    spec = importlib.util.spec_from_file_location(name, so)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build():
    name = _module_name()
    so = _build_dir(name) / f"{name}.so"
    if so.exists():
        try:
            return _import_built(name, so)
        except ImportError as e:  # a link cut short: build it again
            logger.warning("rebuilding the CPU kernels: %s does not load (%s)", so, e)
            so.unlink(missing_ok=True)
    from torch.utils import cpp_extension

    if not _ensure_ninja():
        raise RuntimeError("ninja not found (pip install ninja)")
    cxx = os.environ.get("CXX", "c++")
    if not shutil.which(cxx.split()[0] if cxx.strip() else "c++"):
        raise RuntimeError(f"no C++ compiler ({cxx!r} not found)")
    build_dir = _build_dir(name)
    build_dir.mkdir(parents=True, exist_ok=True)
    # torch waits forever on a lock file left by a build that was killed (e.g. SIGKILL).
    lock = build_dir / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
        logger.warning("removing a stale build lock %s", lock)
        lock.unlink(missing_ok=True)
    fresh = not any(build_dir.glob(f"{name}*.so"))
    if fresh:
        print(f"[rollout] compiling CPU kernels (one time, ~10-60 s) into {build_dir}",
              file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    module = cpp_extension.load(
        name=name,
        sources=[str(s) for s in _SOURCES],
        # Copies: torch appends its -L/-l flags to these lists, which would change
        # _module_name() for the rest of a process that compiled.
        extra_cflags=list(_CFLAGS),
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(build_dir),
        verbose=False,
    )
    if fresh:
        print(f"[rollout] compiled CPU kernels in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    return module


def load():
    """The compiled extension module, or None if it cannot be built (cached either way)."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if not _tried:
            try:
                _module = _build()
            except Exception as e:  # compile error, missing toolchain, ...
                lines = str(e).strip().splitlines() or [""]
                # A compile failure's message is the whole ninja log: show its first error.
                errors = [ln for ln in lines[1:] if "error" in ln.lower()]
                logger.warning("C++ CPU kernels unavailable, using the pure-torch fallback "
                               "(%s: %s)", type(e).__name__, (errors or lines)[0].strip()[:300])
                logger.debug("C++ CPU kernel build failure", exc_info=True)
                _module = None
            _tried = True
    return _module


def built():
    """The extension module if it is compiled for this torch and CPU already, else None, never
    compiling (a trainer packs weights with it only where an engine on this machine built it)."""
    global _module, _tried
    if _tried:
        return _module
    name = _module_name()
    so = _build_dir(name) / f"{name}.so"
    if not so.exists():
        return None
    with _lock:
        if not _tried:
            try:
                _module, _tried = _import_built(name, so), True
            except ImportError:
                return None
    return _module


_DTYPES = ("float32", "bfloat16")
# head sizes each op family is compiled for (csrc: 16-float vectors, at most 32 of them per head)
_HEAD_DIM_RULES = {"attention": lambda d: d % 16 == 0 and 0 < d <= 512,
                   "rotary": lambda d: d % 2 == 0 and 0 < d <= 512}


def ops_for(device, dtype):
    """The extension module if its ops take tensors of this device and dtype, else None."""
    if getattr(device, "type", device) != "cpu" or str(dtype).removeprefix("torch.") not in _DTYPES:
        return None
    return load()


@functools.cache
def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists this CPU feature flag (e.g. "amx_bf16")."""
    return flag in _cpu_flags().split()


def supports_head_dim(op: str, head_dim: int) -> bool:
    """Whether the "attention" or "rotary" ops are built for heads of this size."""
    return _HEAD_DIM_RULES[op](head_dim)
