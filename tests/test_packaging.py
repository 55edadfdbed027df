"""Packaging facts: our top-level `kernels` package must not look like HF's `kernels` package to
transformers, `engine` never imports `rollout`, and no script shadows a package. Checked in one
fresh interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import importlib, json, pkgutil, sys
import engine
for m in pkgutil.walk_packages(engine.__path__, 'engine.'):  # every engine module, not only the package
    importlib.import_module(m.name)
rollout = sorted(m for m in sys.modules if m == 'rollout' or m.startswith('rollout.'))
import kernels, kernels.sampling, kernels.rotary
import transformers.utils as u
from transformers.models.llama import modeling_llama  # model code that probes for hub kernels
print(json.dumps(dict(rollout=rollout, kernels_file=kernels.__file__, kernels_available=u.is_kernels_available(),
                      exports=[n for n in ('LLM', 'AsyncLLM', 'SamplingParams', 'RequestOutput', 'CompletionOutput',
                               'StreamingInput', 'EngineDeadError', 'InvalidRequestError', 'UnsupportedModelError')
                               if hasattr(engine, n)])))
"""


@pytest.fixture(scope="module")
def facts():
    res = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=120,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_transformers_does_not_mistake_our_kernels_for_hf_kernels(facts):
    assert Path(facts["kernels_file"]).resolve().is_relative_to(ROOT), facts["kernels_file"]
    assert facts["kernels_available"] is False


def test_engine_does_not_import_rollout(facts):
    assert facts["rollout"] == []


def test_engine_exports_the_public_names(facts):
    assert len(facts["exports"]) == 9, facts["exports"]


def test_no_script_shadows_a_package():
    """`python benchmarks/x.py` puts benchmarks/ first on sys.path: a script named like one of our
    packages would be imported in its place (benchmarks/weight_sync.py once broke `make bench`)."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
    for folder in ("benchmarks", "recipes"):
        scripts = {p.stem for p in (ROOT / folder).glob("*.py")}
        assert not scripts & packages, f"{folder}/ has scripts named like packages: {scripts & packages}"
