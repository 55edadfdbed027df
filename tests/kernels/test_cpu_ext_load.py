"""Loading the built C++ kernels in a new process: no wait on a lock a killed process left behind.

torch's extension loader takes a lock file in the build folder and runs ninja in every process
that loads it; an engine killed during that (tests and supervisors kill engines at start-up)
left the lock, and every later process waited on it (tensor-parallel ranks then missed their
group's 120 s join). A built library is imported directly."""
import subprocess
import sys
import time

import pytest

from kernels import cpu_ext


def test_a_leftover_lock_does_not_block_a_new_process():
    if cpu_ext.load() is None:
        pytest.skip("the C++ kernels cannot be built here")
    name = cpu_ext._module_name()
    lock = cpu_ext._build_dir(name) / "lock"
    lock.touch()  # as a process killed inside torch's loader leaves it
    try:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", "from kernels import cpu_ext; print(cpu_ext.load().__name__)"],
                             capture_output=True, text=True, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == name
        assert time.monotonic() - t0 < 60
    finally:
        lock.unlink(missing_ok=True)


def test_the_module_name_survives_a_build_in_this_process(monkeypatch, tmp_path):
    """torch's cpp_extension.load appends its -L/-l flags to the extra_ldflags list it is given;
    with the module's own list, every later _module_name() in a process that compiled named
    another folder (a fresh clone's first test run then looked for the wrong lock and library)."""
    if cpu_ext.load() is None:
        pytest.skip("the C++ kernels cannot be built here")
    from torch.utils import cpp_extension

    def load_like_torch(name, sources, extra_cflags, extra_ldflags, build_directory, verbose):
        extra_cflags.append("-DEXTRA")  # what torch's loader does to the lists it gets
        extra_ldflags.extend(["-L/torch/lib", "-ltorch"])
        return name

    monkeypatch.setenv("ROLLOUT_CACHE", str(tmp_path))  # an empty cache: _build() compiles
    monkeypatch.setattr(cpp_extension, "load", load_like_torch)
    before = cpu_ext._module_name()
    assert cpu_ext._build() == before
    assert cpu_ext._module_name() == before
