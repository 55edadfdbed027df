"""A shortened soak (slow): benchmarks/soak.py with 60 sleep/wake cycles and 20 full pushes; the
full run (1,000 and 500) is the benchmark, numbers in the README."""
import re
import subprocess
import sys

import pytest

from tests.rollout.conftest import REPO_ROOT

pytestmark = pytest.mark.slow


def test_sleep_wake_and_push_cycles_keep_memory_flat():
    out = subprocess.run([sys.executable, "benchmarks/soak.py", "--sleep-cycles", "60", "--push-cycles", "20",
                          "--every", "10"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {m.group(1): m for m in re.finditer(r"^(sleep|push)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+"
                                                r"(-?[\d.]+)%\s+(\w+)$", out.stdout, re.M)}
    assert set(rows) == {"sleep", "push"}, out.stdout
    for kind, m in rows.items():
        assert abs(float(m.group(7))) < 5.0, f"{kind}: RSS drifted {m.group(7)}%"
        assert m.group(8) == "same", f"{kind}: the weights checksum changed"
