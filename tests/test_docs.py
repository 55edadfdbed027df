"""The documentation runs as written: every fenced ```python and ```bash block of README.md and
docs/*.md, in document order, against one real server started as `make serve` starts it
(`rollout serve --host 127.0.0.1`, default model, default dtype) on a free port.

The docs say http://127.0.0.1:8000; the test rewrites `127.0.0.1:8000` in each block to the test
server's host:port before running it. Python blocks run with this interpreter (the repository's
.venv) in a fresh temporary folder; bash blocks run with `bash -e` from the repository root (as a
user runs them from a clone). A block that must not run has `<!-- not run: reason -->` on the
line before its fence; output samples use the fence language `text`. The fast tests check the
docs' shape: README length, links that resolve, no wording that points outside the repository.
"""
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(.+?)\s*-->\s*$")
DOCS_URL = "127.0.0.1:8000"
MAX_README_LINES = 420
BLOCK_TIMEOUT_S = 300
STARTUP_TIMEOUT_S = 300


def blocks(path: Path) -> list[dict]:
    """Every fenced block: {"path", "line", "lang", "code", "not_run" (reason or None)}."""
    out, lines, i = [], path.read_text().splitlines(), 0
    while i < len(lines):
        m = FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        start, lang = i, m.group(1)
        j = i + 1
        while j < len(lines) and lines[j].strip() != "```":
            j += 1
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        reason = NOT_RUN.match(prev.strip())
        indent = len(lines[start]) - len(lines[start].lstrip())
        code = "\n".join(line[indent:] for line in lines[start + 1:j])
        out.append({"path": path, "line": start + 1, "lang": lang, "code": code,
                    "not_run": reason.group(1) if reason else None})
        i = j + 1
    return out


def all_blocks() -> list[dict]:
    return [b for path in DOCS for b in blocks(path)]


def runnable(b: dict) -> bool:
    return b["lang"] in ("python", "bash") and b["not_run"] is None


def block_id(b: dict) -> str:
    return f"{b['path'].relative_to(REPO)}:{b['line']}"


# ---- fast: the docs' shape ---------------------------------------------------------------------------
def test_readme_is_short_and_links_the_docs():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines (at most {MAX_README_LINES})"
    linked = set(re.findall(r"\]\((docs/[\w.-]+\.md)", "\n".join(lines)))
    for name in ("architecture", "http-api", "rl", "performance"):
        assert f"docs/{name}.md" in linked, f"README.md does not link docs/{name}.md"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        file = target.split("#")[0]
        assert (path.parent / file).exists(), f"{path.name}: the link {target!r} resolves to nothing"


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_no_wording_from_outside_the_repository(path):
    text = path.read_text()
    # "session" alone is a feature (multi-turn sessions); a work session is named by its neighbours
    for pattern in (r"\.\./shared", r"(?i)\bissues? #?\d+", r"(?i)\b(latest|this|that|previous|earlier|later|last) "
                    r"sessions?\b", r"(?i)\bsessions? (before|ago|earlier)\b"):
        m = re.search(pattern, text)
        assert m is None, f"{path.name}: {m.group(0)!r} at line {text[:m.start()].count(chr(10)) + 1}"


def test_not_run_blocks_are_few_and_say_why():
    skipped = [b for b in all_blocks() if b["not_run"] is not None]
    assert all(b["not_run"] for b in skipped)
    assert len(skipped) <= 10, [block_id(b) for b in skipped]
    unknown = [block_id(b) for b in all_blocks() if b["lang"] not in ("python", "bash", "text", "")]
    assert not unknown, f"fenced blocks in a language the test neither runs nor knows as output: {unknown}"


# ---- slow: every block against a real server ------------------------------------------------------------
@pytest.fixture(scope="module")
def docs_server():
    from rollout.subprocess_server import start

    log = tempfile.NamedTemporaryFile("w", prefix="rollout-docs-", suffix=".log", delete=False)
    log.close()
    server = start("--host", "127.0.0.1", log_path=log.name, cwd=REPO, timeout_s=STARTUP_TIMEOUT_S)
    yield server
    code = server.stop(60)
    assert code == 0, f"rollout serve exited with {code}:\n{server.log()}"


@pytest.mark.slow
def test_docs_code_blocks_run(docs_server):
    """One test over all blocks in order (they share the server: later blocks see earlier pushes)."""
    host_port = docs_server.url.removeprefix("http://")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    todo = [b for b in all_blocks() if runnable(b)]
    skipped = [f"{block_id(b)} ({b['not_run']})" for b in all_blocks() if b["not_run"] is not None]
    assert todo, "no runnable blocks found"
    times = []
    for b in todo:
        code = b["code"].replace(DOCS_URL, host_port)
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="rollout-docs-") as tmp:
            if b["lang"] == "python":
                cmd, cwd = [sys.executable, "-c", code], tmp
            else:
                cmd, cwd = ["bash", "-e", "-c", code], REPO
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S)
        times.append(f"{block_id(b)} {time.monotonic() - t0:.1f} s")
        assert proc.returncode == 0, (f"{block_id(b)} ({b['lang']}) failed with {proc.returncode}:\n{code}\n"
                                      f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}")
        assert "Traceback" not in proc.stderr, f"{block_id(b)}: {proc.stderr[-3000:]}"
        assert '"error"' not in proc.stdout, f"{block_id(b)} printed an error answer:\n{proc.stdout[-3000:]}"
    print(f"\nran {len(todo)} blocks:\n  " + "\n  ".join(times) + f"\nnot run ({len(skipped)}):\n  "
          + "\n  ".join(skipped))
