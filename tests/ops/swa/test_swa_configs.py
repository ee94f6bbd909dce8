"""Default tile shapes of the sliding-window attention kernels."""

import pytest
import torch

from gdn2.ops.swa.configs import SHARED_MEMORY_BUDGET, BwdConfig, FwdConfig, default_configs, streamed_bytes


def test_interpreter_tiles_are_small_and_take_dq_from_ds():
    fwd, bwd = default_configs(64, torch.device("cpu"))
    assert fwd == FwdConfig(32, 16, 4, 1)
    assert bwd == BwdConfig(16, 32, 4, 1, 32, 16, 4, 1, dq_from_ds=True, ds_block_m=32, ds_num_stages=1)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_cuda_tiles_fit_shared_memory_for_every_dtype(head_dim, ops_settings):
    """The CUDA tile shapes are measured for bf16; fp32 inputs double every pipelined buffer, so the
    streamed tiles must shrink until they fit (a 128 x 128, 3-stage forward needs 384 KB in fp32, beyond
    Hopper's 227 KB). 16-bit inputs keep the measured shapes."""
    ops_settings(interpret=False)
    cuda = torch.device("cuda")
    half = default_configs(head_dim, cuda, torch.bfloat16)
    assert default_configs(head_dim, cuda, torch.float16) == half
    fwd, bwd = default_configs(head_dim, cuda, torch.float32)
    for f, b, size in ((fwd, bwd, 4), (*half, 2)):
        assert streamed_bytes(f.block_n, f.num_stages, head_dim, size) <= SHARED_MEMORY_BUDGET
        assert streamed_bytes(b.dq_block_n, b.dq_num_stages, head_dim, size) <= SHARED_MEMORY_BUDGET
        assert streamed_bytes(b.block_m, b.num_stages, head_dim, size) <= SHARED_MEMORY_BUDGET
    if head_dim == 128:
        assert half[0].block_n == 128 and fwd.block_n == 64  # the measured bf16 tile, halved for fp32
        assert half[0].tma and half[1].dq_from_ds and not fwd.tma and not bwd.dq_tma
