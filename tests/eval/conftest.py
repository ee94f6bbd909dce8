"""The lm-eval adapter over the tiny checkpoint (``artifacts``, tests/conftest.py), and an offline, single-thread
harness for every evaluation test."""

import pytest
import torch


@pytest.fixture(scope="session")
def lm(artifacts):
    """The lm-eval adapter over the checkpoint, in float64 (exact comparisons), batch size 3."""
    import gdn2.eval.lm  # noqa: F401  registers "gdn2"
    from gdn2.eval.lm import GDN2LM

    folder, _, _ = artifacts
    return GDN2LM(checkpoint=str(folder / "model.pt"), dtype="float64", device="cpu", batch_size=3)


@pytest.fixture(autouse=True)
def _offline_single_thread(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # The test tensors are tiny: one thread is faster, and far faster on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
