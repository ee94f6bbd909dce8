"""gdn2.ops.backend: the one backend rule of every operator and the environment switches."""

import pytest
import torch

from gdn2.ops import backend
from gdn2.ops.backend import BACKENDS, OPERATORS, Settings, override, reload_settings, select_backend, settings

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("flash_installed", [False, True])
@pytest.mark.parametrize("op", OPERATORS)
def test_one_rule_for_every_operator(op, flash_installed, monkeypatch):
    """Default: flash-attn for SWA on CUDA when installed, else Triton on CUDA, torch elsewhere. A forced
    backend wins, except ``flash`` for an operator without a flash-attn path, which means the default."""
    monkeypatch.setattr(backend, "_installed", lambda module: flash_installed and module == "flash_attn")
    has_flash = op == "swa"
    default_cuda = "flash" if has_flash and flash_installed else "triton"
    assert select_backend(op, CPU) == "torch"
    assert select_backend(op, CUDA) == default_cuda
    for device, default in ((CPU, "torch"), (CUDA, default_cuda)):
        assert select_backend(op, device, "triton") == "triton"
        assert select_backend(op, device, "torch") == "torch"
        assert select_backend(op, device, "flash") == ("flash" if has_flash else default)


def test_environment_backend_applies_to_every_operator_and_the_argument_wins(ops_settings):
    ops_settings(backend="triton")
    assert [select_backend(op, CPU) for op in OPERATORS] == ["triton"] * len(OPERATORS)
    assert select_backend("gdn2", CPU, "torch") == "torch"


def test_unknown_backend_or_operator_is_refused():
    with pytest.raises(ValueError, match="GDN2_BACKEND / backend must be one of"):
        select_backend("gdn2", CPU, "cuda")
    with pytest.raises(ValueError, match="unknown operator"):
        select_backend("attention", CPU)


def test_switches_parsed_from_the_environment():
    assert Settings.from_env({}) == Settings()
    s = Settings.from_env({"GDN2_BACKEND": "torch", "TRITON_INTERPRET": "1", "GDN2_AUTOTUNE": "1",
                           "GDN2_SKIP_CONFIGS": "gdn2_prep_kernel:1, gdn2_bwd_wy_kernel:2,",
                           "GDN2_SWA_DS_SCRATCH_MB": "0.5"})
    assert s == Settings(backend="torch", interpret=True, autotune=True, ds_scratch_mb=0.5,
                         skip_configs=frozenset({"gdn2_prep_kernel:1", "gdn2_bwd_wy_kernel:2"}))
    assert s.ds_scratch_bytes == 2 ** 19
    assert Settings.from_env({"GDN2_BACKEND": "", "TRITON_INTERPRET": "0"}) == Settings()
    with pytest.raises(ValueError, match="GDN2_BACKEND"):
        Settings.from_env({"GDN2_BACKEND": "cuda"})
    with pytest.raises(ValueError, match="GDN2_SWA_DS_SCRATCH_MB"):
        Settings.from_env({"GDN2_SWA_DS_SCRATCH_MB": "lots"})
    assert set(BACKENDS) == {"triton", "torch", "flash"}


def test_read_once_reread_on_request_and_overridden_in_a_block(monkeypatch):
    before = settings()
    monkeypatch.setattr(backend, "_current", before)  # the switches of the session come back afterwards
    monkeypatch.setenv("GDN2_BACKEND", "torch")
    assert settings() is before  # read once, not at every call
    assert reload_settings().backend == "torch" and settings().backend == "torch"
    with override(backend="triton", ds_scratch_mb=1.0) as inside:
        assert settings() is inside and inside.backend == "triton" and inside.ds_scratch_bytes == 2 ** 20
    assert settings().backend == "torch"
