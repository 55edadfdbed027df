"""ServerConfig: the HTTP server's options (the engine's own options are EngineConfig fields)."""
import os
import re
from dataclasses import dataclass, field

MiB = 1 << 20
# worker methods a caller may run through /collective_rpc without registering them: read-only
DEFAULT_RPC_METHODS = ("get_rank", "ping", "model_info", "weights_checksum")


@dataclass
class ServerConfig:
    """host/port: where to listen (loopback by default; port 0 = any free port, printed when ready).
    api_key: Bearer key required on every route but /health (env ROLLOUT_API_KEY).
    admin_api_key: Bearer key required on control and weight routes (env ROLLOUT_ADMIN_API_KEY);
        it also opens every other route. Once either key is set, every route but /health needs
        one, and the admin routes need the admin key (with only api_key they are closed).
    max_body_bytes: larger request bodies are refused with 413.
    collective_rpc_methods: worker methods /collective_rpc may call, beyond DEFAULT_RPC_METHODS.
    apply_model_fns: the functions /apply_model may run on the workers' models, by import path
        ("package.module:function"); none by default.
    shutdown_grace_s: on SIGINT/SIGTERM, in-flight requests get this long to finish, then are
        aborted (they still get a final response, finish_reason "abort").
    api_server_count: API-server processes sharing the listening socket (rollout/launcher.py).
    control_lock: a file the API servers of one launcher lock in turn, so that their control
        routes run one at a time across them; the state the routes share lies beside it (set by
        the launcher; rollout/api/state.py).
    exit_on_engine_death: once no engine replica lives, log why and exit with status 1 (as vLLM
        does, so that an orchestrator restarts the server); False: stay up answering 503.
    session_timeout_s: a session (rollout/api/sessions.py) idle this long is closed, its KV freed
        (a session may ask for its own timeout); max_sessions: more open sessions get 429.
    lora_modules: LoRA adapters (name, PEFT folder) loaded at start, served as models of those names.
    max_encode_inputs: inputs one /v1/embeddings, /pooling or /classify call may carry (OpenAI's
        embeddings API takes 2048); more is a 400 naming `input`, before anything is tokenized.
    max_request_tokens: tokens one generation request may ask to sample, summed over its prompts:
        prompts x n x max_tokens (an unset max_tokens counts as the room the context leaves the
        prompt); more is a 400 naming max_tokens, before the engine sees the request. The server
        holds a request's whole answer until it is sent, so this bounds what one request costs
        the API server (measured ~0.2 KB a sampled token with logprobs: ~400 MB at the default).
    log_requests: log one line per request on stderr (method, path, status, ms); False keeps only
        the failed ones. Pauses, weight pushes, sleep and wake-up are logged either way.
    min_weight_version: GET /ready answers 503 until every replica holds at least this weight
        version (a server restarted in the middle of a run: the version the trainer last pushed).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    max_body_bytes: int = 16 * MiB
    collective_rpc_methods: tuple[str, ...] = ()
    apply_model_fns: tuple[str, ...] = ()
    stats_interval_s: float = 1.0
    shutdown_grace_s: float = 5.0
    wandb_project: str | None = None
    wandb_run_name: str | None = None
    wandb_interval_s: float = 5.0
    log_level: str = "warning"
    engine_kwargs: dict = field(default_factory=dict)  # EngineConfig fields for AsyncLLM(model, **kw)
    model: str | None = None
    api_server_count: int = 1
    api_server_index: int = 0  # which of them this process is (set by the launcher)
    control_lock: str | None = None
    exit_on_engine_death: bool = True
    session_timeout_s: float = 600.0
    max_sessions: int = 4096
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT folder) LoRA adapters loaded at start
    max_encode_inputs: int = 2048
    max_request_tokens: int = 1 << 21
    log_requests: bool = True
    min_weight_version: int = 0

    def __post_init__(self):
        self.api_key = self.api_key or os.environ.get("ROLLOUT_API_KEY") or None
        self.admin_api_key = self.admin_api_key or os.environ.get("ROLLOUT_ADMIN_API_KEY") or None
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if not isinstance(self.api_server_count, int) or self.api_server_count < 1:
            raise ValueError(f"api_server_count must be a positive int, got {self.api_server_count!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_encode_inputs < 1 or self.max_request_tokens < 1:
            raise ValueError("max_encode_inputs and max_request_tokens must be at least 1")
        if not self.session_timeout_s > 0 or self.max_sessions < 1:
            raise ValueError("session_timeout_s must be positive and max_sessions at least 1")
        for m in self.collective_rpc_methods:
            if not m.isidentifier() or m.startswith("_"):
                raise ValueError(f"collective_rpc method {m!r} must be a public method name")
            if m == "apply_model":  # through /collective_rpc a caller would name any function
                raise ValueError("register the functions themselves with --apply-model-fn, not apply_model as a "
                                 "collective_rpc method")
        for f in self.apply_model_fns:
            if not re.fullmatch(r"[A-Za-z_][\w.]*[.:][A-Za-z_][\w.]*", f):
                raise ValueError(f"apply_model function {f!r} must be an import path ('package.module:function')")

    @property
    def rpc_methods(self) -> frozenset[str]:
        return frozenset(DEFAULT_RPC_METHODS) | frozenset(self.collective_rpc_methods)

    def allows_apply_model(self, fn: str) -> bool:
        """Whether `fn` names a registered function ("a.b:f" and "a.b.f" name the same one)."""
        return fn.replace(":", ".") in {f.replace(":", ".") for f in self.apply_model_fns}
