"""The listening socket and the ready banner, shared by one API server (rollout/server.py) and the
launcher of several (rollout/launcher.py); a leaf: it imports neither."""
import ipaddress
import socket

from rollout.config import ServerConfig
from rollout.log import log


def listen(config: ServerConfig) -> socket.socket:
    if config.api_key is None and config.admin_api_key is None and not is_loopback(config.host):
        log(f"WARNING: listening on {config.host} without --api-key: anyone who can reach it can generate, "
            "pause, and replace the weights")
    if config.api_key is not None and config.admin_api_key is None:
        log("WARNING: --api-key without --admin-api-key: the admin routes (pause, weights, sleep, ...) are "
            "closed; pass --admin-api-key to use them")
    if config.admin_api_key is not None and config.api_key is None:
        log("note: --admin-api-key without --api-key: generation takes the admin key too")
    sock = socket.create_server((config.host, config.port), reuse_port=False)
    # asyncio sets TCP_NODELAY on an accepted connection only when the socket's proto says TCP, and
    # create_server leaves it 0: with Nagle on, each response's second write (the body after the
    # headers, every SSE chunk after the first) waited for the client's delayed ACK, ~40 ms per
    # request on a keep-alive connection. The same file descriptor, re-wrapped with proto TCP:
    return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def banner(config: ServerConfig, model: str, url: str, engine_config, max_model_len: int) -> str:
    """The ready lines (stdout): the first says where it serves (tools read the URL from it:
    rollout/subprocess_server.py), the second what and how to stop it."""
    auth = " (API key required)" if config.api_key else ""
    n, k = engine_config.data_parallel_size, config.api_server_count
    servers = f", {k} API servers" if k > 1 else ""
    tp = engine_config.tensor_parallel_size
    ranks = f" of {tp} tensor-parallel ranks" if tp > 1 else ""
    return (f"[rollout] serving {model} on {url}{auth}\n"
            f"[rollout] {engine_config.dtype} on {engine_config.device}, {n} replica{'s' if n > 1 else ''}{ranks}{servers}, "
            f"max_model_len {max_model_len}; Ctrl-C (or SIGTERM) stops it")
