"""Fuzz (slow): schemathesis generates requests for every operation of the served OpenAPI document
(valid and invalid bodies, queries and paths; derandomized, a bounded number per operation) and
sends them with the admin key to a real server. No request may get a 5xx, and the server must
stay up throughout.

Bounded so the run fits CI: sample counts and token budgets in generated bodies are capped, so
are timeouts; /scale (which starts engine processes) is left out. After every call the server is
put back to serving (resume, wake up, reload after a sleep) so later operations meet a live
engine.
"""
import shutil
import tempfile

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.rollout.conftest import ADMIN_KEY, REPO_ROOT, start_server, stop_server

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CAPS = {"n": 2, "best_of": 2, "max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 4, "timeout_s": 2.0,
        "timeout": 2.0, "drain_timeout_s": 2.0, "drain_timeout": 2.0, "world_size": 3,
        "min_weight_version": 0}  # (a version above the live one waits for a push that never comes)
seen: dict[str, int] = {}  # status -> count, printed at the end
# routes that answer 501 by design (rollout/compat/trl.py: `trl vllm-serve`'s NCCL weight routes;
# /v1/chat/completions/render for images; rollout/compat/vllm_rl.py: prime-rl's NCCL broadcaster)
NOT_IMPLEMENTED = {"/init_communicator/", "/update_named_param/", "/close_communicator/",
                   "/v1/chat/completions/render", "/init_broadcaster"}


@pytest.fixture(scope="module")
def fuzz_server():
    before = set(REPO_ROOT.iterdir())
    server = start_server("--max-model-len", "64")
    yield server
    assert set(REPO_ROOT.iterdir()) == before, f"the fuzz run left files in the repo: {set(REPO_ROOT.iterdir()) - before}"
    assert server.proc.poll() is None, f"the server died during the fuzz run:\n{server.log()}"
    print(f"schema fuzz: {sum(seen.values())} requests, statuses {dict(sorted(seen.items()))}")
    assert stop_server(server) == 0, server.log()


def cap(value):
    """Bound what makes a call slow (samples, tokens, waits) anywhere in a generated body."""
    if isinstance(value, dict):
        return {k: (min(v, CAPS[k]) if k in CAPS and isinstance(v, (int, float)) and not isinstance(v, bool)
                    else cap(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [cap(v) for v in value]
    return value


def test_no_request_gets_a_server_error(fuzz_server):
    schema = schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json", headers=ADMIN)
    operations = [r.ok() for r in schema.get_all_operations()]
    operations = [op for op in operations if not op.path.startswith("/scale")]
    assert len(operations) > 30, [op.path for op in operations]
    for op in operations:
        @settings(max_examples=6, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def call(case):
            check_one(case, fuzz_server)

        call()


def confine(body: dict, root: str) -> dict:
    """/save_weights writes where it is told, and this runs as whatever user CI has (root, often):
    an absolute path is re-rooted under a temporary folder. A relative one is sent as generated,
    since the server refuses it (400) before writing anything."""
    path = body.get("path")
    if isinstance(path, str) and path.startswith("/"):
        body = dict(body, path=root + "/" + path.lstrip("/"))
    return body


def check_one(case, fuzz_server) -> None:
    if isinstance(case.body, (dict, list)):
        case.body = cap(case.body)
    info = case.body.get("init_info") if isinstance(case.body, dict) else None
    if isinstance(info, dict):  # (a group no trainer joins waits out its timeout: 60 s unless given)
        info.setdefault("timeout_s", CAPS["timeout_s"])
    scratch = None
    if case.path == "/save_weights" and isinstance(case.body, dict):
        scratch = tempfile.mkdtemp(prefix="fuzz-save-")
        case.body = confine(case.body, scratch)
    if isinstance(case.query, dict):
        case.query = cap(case.query)
    response = case.call(base_url=fuzz_server.url, headers=ADMIN, timeout=120)
    seen[str(response.status_code)] = seen.get(str(response.status_code), 0) + 1
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    allowed = response.status_code == 501 and case.path in NOT_IMPLEMENTED
    assert response.status_code < 500 or allowed, (f"{case.method} {case.path} -> {response.status_code}: "
                                                   f"{response.text[:500]}\nbody: {case.body!r}\nquery: {case.query!r}")
    with httpx.Client(base_url=fuzz_server.url, headers=ADMIN, timeout=120) as http:
        http.post("/wake_up")
        http.post("/resume")
        if case.path == "/sleep":  # level 2 dropped the weights
            http.post("/reload_weights", json={})
        assert http.get("/health").status_code == 200
