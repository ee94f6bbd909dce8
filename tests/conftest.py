import os
import sys
from contextlib import ExitStack
from pathlib import Path

# Test tensors are tiny: one thread per process (this one, and the trainers and ranks the tests start)
# avoids oversubscribing small CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The multi-process tests' ranks talk over gloo on the loopback interface only.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter; the flag must be set before any
# kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tests"):  # the package, and helper modules shared by the tests
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    # The slow tests first: with ``-n 2`` they spread over both workers instead of ending the run on one.
    items.sort(key=lambda item: "slow" not in item.keywords)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def ops_settings():
    """Override gdn2.ops's environment switches for one test: ``ops_settings(backend="triton")`` (fields
    of ``gdn2.ops.backend.Settings``); the switches read before the test come back after it."""
    from gdn2.ops.backend import override

    with ExitStack() as stack:
        yield lambda **changes: stack.enter_context(override(**changes))


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """(folder, Tokenizer, Config) of a tiny checkpoint: model.pt {model, config} and tokenizer.model
    (tests/tiny_checkpoint.py)."""
    from tiny_checkpoint import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a folder on a real file system of ``size`` ("800k", "5m": a tmpfs mounted for
    the test and unmounted after it), for tests of a full disk. Skips where mounting is impossible
    (not root, or no mount permission in the container)."""
    import subprocess

    mounted = []

    def mount(size: str) -> Path:
        folder = tmp_path / f"disk{len(mounted)}"
        folder.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                                  capture_output=True, text=True)
        except FileNotFoundError:
            pytest.skip("cannot mount a tmpfs here: no mount command")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)
