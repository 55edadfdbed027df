import os
import shutil

import pytest

from kernels import cpu_ext


@pytest.fixture(scope="module")
def ext():
    """The compiled C++ kernels. Skipped only on a machine without a C++ compiler: where one
    exists, a failed build fails the tests (the engine would silently run the torch fallbacks)."""
    module = cpu_ext.load()
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if module is None:
        if compiler is None:
            pytest.skip("no C++ compiler: the C++ CPU kernels cannot be built here")
        pytest.fail(f"the C++ CPU kernels could not be built with {compiler} (see the 'kernels' log warning)")
    return module
