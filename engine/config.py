"""EngineConfig: one flat dataclass of engine options, checked in __post_init__; ModelConfig:
the architecture facts the engine needs, read from a Hugging Face folder's config.json."""
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.errors import UnsupportedModelError
from kernels.kv_quant import SCALE_BYTES

FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
# causal LMs (generate, embed) and sequence classifiers (classify: reward models)
# vision-language models: a SigLIP-style vision encoder + pixel-shuffle connector in front of a Llama
VISION_ARCHITECTURES = ("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration")
# mixture-of-experts decoders: the same attention, a routed SwiGLU expert MLP in place of the dense one
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
SUPPORTED_ARCHITECTURES = tuple(f"{f}For{kind}" for kind in ("CausalLM", "SequenceClassification")
                                for f in FAMILIES) + VISION_ARCHITECTURES + MOE_ARCHITECTURES
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GiB = 1 << 30


@dataclass
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    sliding_window: int | None
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str
    num_labels: int = 0  # a sequence classifier's outputs (its `score` head); 0 for a causal LM
    id2label: dict[int, str] = field(default_factory=dict)  # a classifier's label names
    text_prefix: str = "model."  # where the decoder's weights live ("model.text_model." in a VLM)
    vision: dict | None = None  # a VLM's vision_config, plus its scale_factor and image_token_id
    moe: "MoEConfig | None" = None  # a mixture-of-experts model's experts and router

    @classmethod
    def from_folder(cls, path: str) -> "ModelConfig":
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise UnsupportedModelError(f"{path}: not a model folder (no config.json)")
        if not any(folder.glob("*.safetensors")):
            raise UnsupportedModelError(f"{path}: no *.safetensors weights")
        top = json.loads((folder / "config.json").read_text())
        arch = (top.get("architectures") or [_ARCH_BY_TYPE.get(top.get("model_type"), "?")])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        vision = None
        cfg = top
        if arch in VISION_ARCHITECTURES:
            cfg = dict(top["text_config"], tie_word_embeddings=top.get("tie_word_embeddings", False))
            if cfg.get("model_type", "llama") != "llama":
                raise UnsupportedModelError(f"{path}: a {arch} with a {cfg.get('model_type')!r} decoder "
                                            "(only Llama decoders are supported)")
            vision = dict(top["vision_config"], scale_factor=top.get("scale_factor", 2),
                          image_token_id=top["image_token_id"])
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        window = cfg.get("sliding_window")
        family = "Llama" if vision else arch.split("For")[0]
        moe = MoEConfig.of(arch, cfg) if arch in MOE_ARCHITECTURES else None
        family = {"Qwen3Moe": "Qwen3", "Mixtral": "Mistral"}.get(family, family)
        if family in ("Qwen2", "Qwen3") and not cfg.get("use_sliding_window", False):
            window = None
        num_labels = 0
        if arch.endswith("ForSequenceClassification"):
            num_labels = int(cfg.get("num_labels") or len(cfg.get("id2label") or {}) or 2)
        eos = _eos_ids(folder, cfg)
        return cls(
            path=str(folder), architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
            num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta), rope_scaling=None if rope_type == "default" else dict(rope, rope_type=rope_type),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=family == "Qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=family == "Qwen3", sliding_window=window, eos_token_ids=eos,
            bos_token_id=cfg.get("bos_token_id"), torch_dtype=str(top.get("torch_dtype") or top.get("dtype") or cfg.get("dtype") or "float32"),
            num_labels=num_labels, id2label={int(k): str(v) for k, v in (cfg.get("id2label") or {}).items()},
            text_prefix="model.text_model." if vision else "model.", vision=vision, moe=moe,
        )


@dataclass(frozen=True)
class MoEConfig:
    """The experts of a mixture-of-experts decoder (engine/model/moe.py)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights rescaled to sum 1 (Mixtral always; Qwen3-MoE by norm_topk_prob)
    layers: tuple[int, ...]  # the decoder layers whose MLP is the experts (the others stay dense)
    checkpoint_style: str  # "qwen" or "mixtral": how checkpoints name its experts (weight_sync/names.py)

    @classmethod
    def of(cls, arch: str, cfg: dict) -> "MoEConfig":
        n = cfg["num_hidden_layers"]
        if arch == "MixtralForCausalLM":
            return cls(cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"], True,
                       tuple(range(n)), "mixtral")
        step, dense = cfg.get("decoder_sparse_step", 1) or 1, set(cfg.get("mlp_only_layers") or [])
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        layers = tuple(i for i in range(n) if i not in dense and experts > 0 and (i + 1) % step == 0)
        return cls(experts, cfg["num_experts_per_tok"], cfg["moe_intermediate_size"],
                   bool(cfg.get("norm_topk_prob", False)), layers, "qwen")


_ARCH_BY_TYPE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


def _eos_ids(folder: Path, cfg: dict) -> list[int]:
    ids = cfg.get("eos_token_id")
    gen = folder / "generation_config.json"
    if gen.is_file():
        ids = json.loads(gen.read_text()).get("eos_token_id", ids)
    if ids is None:
        return []
    return list(ids) if isinstance(ids, list) else [ids]


@dataclass
class EngineConfig:
    """Engine options. Memory sizes are in bytes.

    model: a local Hugging Face folder, or None for the embedded default model (already converted:
        LLM / AsyncLLM resolve and convert it first; a config never converts anything).
    dtype: "auto" (bfloat16 on GPU and on CPUs where our bf16 matmuls run: AMX, AVX-512, AVX2 + FMA
        with the C++ kernels built; float32 otherwise), or
        "float32" / "bfloat16" / "float16".
    kv_cache_memory: bytes for the KV cache; None = 2 GiB on CPU (pages are touched only as
        they fill), on CUDA gpu_memory_utilization of the device minus weights and activations.
    kv_cache_dtype: "auto" (the model's dtype) or "int8": each token's key and value rows of each kv
        head stored as 8-bit codes and one float32 scale (kernels/kv_quant.py), about half a bf16
        cache's bytes: nearly twice the tokens in the same kv_cache_memory, and half the bytes a
        decode step's attention reads. Numerics change (every cached value within half a step of
        127 of its row's maximum; docs/performance.md measures the logprob drift against
        transformers), so it is off by default. CPU only, head_dim a multiple of 16, not with
        batch_invariant (the trainer's recompute keeps the exact values).
    max_num_batched_tokens: the token budget of one step (prefill chunks + decodes); None = 1024
        on CPU (a full step takes ~0.6 s there for the default model: running requests wait at
        most that long behind a prefill, and a burst of prompts is answered in pieces; 2048 gave a
        ~40% higher mean TTFT under vLLM's bench serve, README), 2048 on CUDA.
    num_threads: torch threads of each worker rank; None = torch's default, or with data or tensor
        parallelism on CPU the cores split evenly between all ranks of all replicas (each rank is
        then pinned to its own cores: they never oversubscribe the machine).
    data_parallel_size: engine-core replicas, each with its own scheduler, KV cache and worker(s);
        data_parallel_backend: "mp" (local processes) or "ray" (Ray actors, any node of a cluster).
    tensor_parallel_size: worker ranks per replica, each holding a shard of the model (its heads,
        intermediate columns and vocabulary rows; engine/model/parallel.py) and of the KV cache:
        rank 0 in the engine-core process, the others in processes of their own
        (engine/worker/multiproc_executor.py). tensor_parallel_transport: how the ranks all-reduce:
        "auto" (shared memory between CPU ranks when the C++ kernels build, NCCL on CUDA), "shm",
        "gloo", "nccl" (benchmarks/allreduce.py compares them).
    max_data_parallel_size: the most replicas start-up or scale() may ask for. None = what the
        machine holds: one replica per num_threads cores on CPU (at least one core each), one
        per GPU on CUDA, the Ray cluster's CPUs / GPUs under Ray. Setting it replaces that
        bound (oversubscribing cores on purpose); scale() still refuses what memory cannot hold.
    batch_invariant: a token's logits and logprobs do not depend on the rest of the batch (fixed
        reduction orders; float32 on CPU; see engine/model/batch_invariant.py for the guarantee and
        the recompute a trainer runs to get the same bits). dtype "auto" becomes float32.
    enforce_eager: run every step op by op from Python. By default all-decode steps of a dense model
        on one GPU replay CUDA graphs captured per padded batch size (engine/worker/cuda_graphs.py),
        and on a CPU run their decoder layers in one C++ call (engine/model/decoder.py's DecodePlan;
        the same ops, the same bits).
    async_scheduling: schedule step N+1 while step N runs (a worker thread runs the steps): the
        scheduler, output handling and the core's IO overlap the forward pass, which matters where
        a step is short and the host's share of it large (a GPU). Step N+1's decodes take step N's
        sampled tokens as their input inside the worker; a request that step N ends computes one
        more row that is dropped. Greedy tokens are the same as without. With tensor parallelism
        rank 0 shares each step's sampled tokens with the other ranks. Not with expert parallelism.
    enable_lora: LoRA adapters (engine/worker/lora.py: add_lora, per-request lora_request); at most
        max_loras resident (the least recently used unpinned one is evicted), ranks <= max_lora_rank.
        max_loras also bounds the adapters of the running requests, pinned ones counted: a request
        for another waits for a slot, and an evicted adapter is reloaded when a request needs it.
    log_stats_interval_s: LLM / AsyncLLM log do_log_stats()'s line (logger "engine", INFO) this often
        while they run; None = only when called.
    profiler_dir: where start_profile() / stop_profile() write torch-profiler traces of the engine
        core (engine/worker/profiler.py); None = profiling off (the calls are refused).
    otlp_traces_endpoint: LLM / AsyncLLM export one OpenTelemetry span per finished request to this OTLP
        HTTP/protobuf URL (e.g. http://localhost:4318/v1/traces; engine/frontend/tracing.py); None = off.
    encoder_cache_size: a vision-language model's encoder cache holds at most this many image
        embeddings (placeholder tokens), least recently used out first.
    enable_expert_parallel: a mixture-of-experts model's experts split between the data-parallel
        replicas (replica r holds about E / data_parallel_size of each layer's experts; tokens go to
        their experts' replica and back by all-to-all; engine/model/moe.py). The replicas then step
        in lockstep (engine/process/waves.py). expert_parallel_address: "host:port" of the group's
        rendezvous (replica 0 hosts it), set by the process manager.
    enable_return_routed_experts: keep every computed token's chosen experts per layer, so that
        requests asking return_routed_experts get them (a mixture-of-experts model only; routing replay).
    heartbeat_interval_s, engine_stall_timeout_s: an engine-core process sends a heartbeat this
        often; check_health() reports a core stalled when none came for engine_stall_timeout_s or
        its loop has been inside one step or call that long (a hung collective, a stuck push).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    seed: int = 0
    num_threads: int | None = None
    tokenizer: str | None = None
    worker_extension_cls: str | None = None
    data_parallel_size: int = 1
    tensor_parallel_size: int = 1
    tensor_parallel_transport: str = "auto"
    data_parallel_backend: str = "mp"
    data_parallel_rank: int = 0  # set per replica by the process / actor manager
    max_data_parallel_size: int | None = None
    batch_invariant: bool = False
    enforce_eager: bool = False
    async_scheduling: bool = False
    profiler_dir: str | None = None
    log_stats_interval_s: float | None = None
    otlp_traces_endpoint: str | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    encoder_cache_size: int = 16384
    enable_expert_parallel: bool = False
    expert_parallel_address: str | None = None
    enable_return_routed_experts: bool = False
    heartbeat_interval_s: float = 1.0
    engine_stall_timeout_s: float = 600.0
    model_config: ModelConfig = field(init=False, repr=False)

    def __post_init__(self):
        self._resolve_model()
        self._resolve_device_and_dtype()
        self._check_sizes()
        self._check_scale_out()

    def _resolve_model(self) -> None:
        """The folder to load (the converted default model for None) and its ModelConfig."""
        from engine.default_model import converted_default_model

        if self.model is None:  # the default model, converted by resolve_model() beforehand
            self.model = str(converted_default_model())
            if not (Path(self.model) / "config.json").is_file():
                raise UnsupportedModelError("the default model is not converted yet: LLM(), AsyncLLM() and "
                                            "`rollout serve` convert it once (engine.default_model.resolve_model)")
        self.model = os.path.expanduser(str(self.model))
        if not Path(self.model).is_dir():
            raise UnsupportedModelError(f"model {self.model!r}: no such local folder (hub downloads are not supported)")
        self.model_config = ModelConfig.from_folder(self.model)

    def _resolve_device_and_dtype(self) -> None:
        """Make the "auto" device and dtype concrete (bf16 on GPU and on CPUs with fast bf16 matmuls),
        and the step's token budget that depends on the device."""
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available")
        if self.device not in ("cpu",) and not self.device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 1024 if self.device == "cpu" else 2048
        if self.dtype == "auto" and self.batch_invariant:
            self.dtype = "float32"
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device != "cpu" or _cpu_has_fast_bf16() else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {list(DTYPES)}, got {self.dtype!r}")
        if self.batch_invariant and (self.device != "cpu" or self.dtype != "float32"):
            raise ValueError(f"batch_invariant runs float32 on CPU (got device={self.device!r}, dtype={self.dtype!r})")

    def _check_sizes(self) -> None:
        """Context length, batch, cache and timing limits: positive and within the model's."""
        limit = self.model_config.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        if not 1 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len must be in [1, {limit}] for this model, got {self.max_model_len}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_loras", "max_lora_rank",
                     "encoder_cache_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("heartbeat_interval_s", "engine_stall_timeout_s"):
            if not isinstance(getattr(self, name), (int, float)) or not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {getattr(self, name)!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.log_stats_interval_s is not None and not self.log_stats_interval_s > 0:
            raise ValueError(f"log_stats_interval_s must be > 0 seconds, got {self.log_stats_interval_s}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        self._check_kv_cache_dtype()

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'int8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "auto":
            return
        if self.device != "cpu":
            raise ValueError("kv_cache_dtype 'int8' runs on CPU only (the CUDA attention kernels read the model's "
                             "dtype): use kv_cache_dtype 'auto' on a GPU")
        if self.batch_invariant:
            raise ValueError("kv_cache_dtype 'int8' does not combine with batch_invariant: the trainer's recompute "
                             "attends over exact keys and values, not 8-bit ones")
        if self.model_config.head_dim % 16:
            raise ValueError(f"kv_cache_dtype 'int8' needs a head_dim that is a multiple of 16 (the kernels' rows), "
                             f"this model's is {self.model_config.head_dim}")

    def _check_scale_out(self) -> None:
        """Replica count, ranks per replica and backend; the cores split between local CPU ranks by default."""
        for name in ("data_parallel_size", "tensor_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.tensor_parallel_transport not in ("auto", "shm", "gloo", "nccl"):
            raise ValueError(f"tensor_parallel_transport must be 'auto', 'shm', 'gloo' or 'nccl', got "
                             f"{self.tensor_parallel_transport!r}")
        if self.tensor_parallel_size > 1 and self.data_parallel_backend == "ray" and self.device.startswith("cuda"):
            raise ValueError("tensor parallelism under the Ray backend runs on CPU only for now (the rank processes "
                             "would not see the GPUs Ray gives the engine-core actor): use the mp backend")
        if self.tensor_parallel_size > 1 and self.batch_invariant:
            raise ValueError("batch_invariant needs tensor_parallel_size 1 (the trainer's recompute has no "
                             "all-reduce to match)")
        moe = self.model_config.moe
        if moe is not None and self.tensor_parallel_size > 1:
            raise ValueError("a mixture-of-experts model runs with tensor_parallel_size 1: split its experts between "
                             "data-parallel replicas instead (enable_expert_parallel)")
        if moe is not None and self.enable_lora:
            raise ValueError("LoRA adapters on mixture-of-experts models are not supported")
        if moe is not None and self.batch_invariant:
            raise ValueError("batch_invariant does not cover mixture-of-experts models (the experts' kernels are not "
                             "batch-invariant)")
        if (self.enable_expert_parallel or self.enable_return_routed_experts) and moe is None:
            flag = "enable_expert_parallel" if self.enable_expert_parallel else "enable_return_routed_experts"
            raise ValueError(f"{flag} needs a mixture-of-experts model ({self.model_config.architecture} is dense)")
        if self.async_scheduling and self.tensor_parallel_size > 1 and self.model_config.vocab_size > 1 << 24:
            raise ValueError("async_scheduling with tensor parallelism shares token ids as float32: a vocabulary "
                             f"of {self.model_config.vocab_size} is above 2^24")
        if self.async_scheduling and self.enable_expert_parallel:
            raise ValueError("async_scheduling does not combine with enable_expert_parallel yet (the replicas' "
                             "lockstep waves run one step at a time)")
        if self.enable_expert_parallel and self.data_parallel_backend != "mp":
            raise ValueError("expert parallelism runs on the mp backend (local replicas) for now")
        if self.max_data_parallel_size is not None and (not isinstance(self.max_data_parallel_size, int)
                                                        or self.max_data_parallel_size < 1):
            raise ValueError(f"max_data_parallel_size must be a positive int, got {self.max_data_parallel_size!r}")
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}")
        ranks = self.data_parallel_size * self.tensor_parallel_size
        if self.num_threads is None and ranks > 1 and self.device == "cpu":
            self.num_threads = max(1, len(available_cpus()) // ranks)

    def init_fields(self) -> dict:
        """The constructor's arguments that make this config again (what travels to other processes)."""
        return {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "model_config"}

    def rank_cpus(self, tp_rank: int = 0) -> list[int] | None:
        """The cores worker rank `tp_rank` of this replica is pinned to (local CPU data or tensor
        parallelism, when the cores divide evenly; under Ray, Ray places the replicas)."""
        cpus = available_cpus()
        n, t = self.data_parallel_size * self.tensor_parallel_size, self.num_threads
        if self.device != "cpu" or n == 1 or not t or n * t > len(cpus) or self.data_parallel_backend == "ray":
            return None
        r = (self.data_parallel_rank % self.data_parallel_size) * self.tensor_parallel_size + tp_rank
        return cpus[r * t:(r + 1) * t]

    @property
    def stages_weights_beside_steps(self) -> bool:
        """Whether a weight update is received while generation goes on, generation pausing only for
        the swap (EngineCore.stage_weights): on a CPU (tensor-parallel ranks in processes of their
        own receive in a thread too: multiproc_executor.CONCURRENT_METHODS). On CUDA the receive
        would need a stream of its own (not built yet): there generation pauses for the whole
        update."""
        return self.device == "cpu"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_codes(self) -> bool:
        """The KV cache holds int8 rows of codes and a scale (kv_cache_dtype "int8")."""
        return self.kv_cache_dtype == "int8"

    def kv_bytes_per_token(self) -> int:
        m = self.model_config
        row_bytes = m.head_dim + SCALE_BYTES if self.kv_codes else m.head_dim * self.torch_dtype.itemsize
        return m.num_layers * 2 * m.num_kv_heads * row_bytes


def available_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _cpu_has_fast_bf16() -> bool:
    """Whether bf16 runs at least as fast as float32 here: native bf16 matmuls (AMX, AVX-512 BF16:
    ours or oneDNN's), or our float32 panels of bf16 weights (AVX2 + FMA or AVX-512, the C++
    kernels built: on an AVX2 EPYC faster than float32 at every batch size, in half the memory).
    Without the kernels an AVX2 CPU's bf16 matmul is torch's, 5-8x slower than its float32 one."""
    from kernels import cpu_ext

    if cpu_ext.cpu_has("amx_bf16") or cpu_ext.cpu_has("avx512_bf16"):
        return True
    ext = cpu_ext.load()
    return ext is not None and ext.f32_panel_supported()
