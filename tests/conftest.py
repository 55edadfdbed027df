import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not os.path.exists("/dev/nvidiactl"):  # no GPU: Triton kernels run in its interpreter on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")  # (read when triton is first imported, by anyone)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> str:
    from engine.default_model import default_model_path

    return str(default_model_path())
