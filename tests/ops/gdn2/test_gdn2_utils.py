"""Launch helpers of the GDN-2 kernels: pinned configs, clipping, the switches that change them, and the
shared-memory fallback."""

import pytest
import torch
import triton
from triton.runtime.errors import OutOfResources

import gdn2.ops.gdn2.utils as tu


class FakeKernel:
    """Stands in for a compiled Triton kernel: records each launch and, like Triton at load time,
    refuses pipelines deeper than ``fits`` stages with OutOfResources."""

    __name__ = "fake_kernel"
    arg_names = ["x", "n", "BK"]

    def __init__(self, fits):
        self.fits = fits
        self.launches = []
        self.caps = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.launches.append((grid, kwargs["BK"], kwargs["num_stages"]))
            self.caps.append(kwargs.get("maxnreg", "absent"))
            if kwargs["num_stages"] > self.fits:
                raise OutOfResources(200_000 * kwargs["num_stages"], 232_448, "shared memory")
            return "ran"
        return run


@pytest.fixture
def compiled_mode(ops_settings):
    # the launcher's GPU branch (with num_warps / num_stages), whatever the test machine
    ops_settings(interpret=False, autotune=False)


def test_pipeline_that_does_not_fit_runs_with_fewer_stages_and_is_remembered(compiled_mode):
    fake = FakeKernel(fits=2)
    kern = tu.Tuned(fake, [triton.Config({"BK": 64}, num_warps=4, num_stages=4)], key=["n"])
    x = torch.zeros(4)
    assert kern[(3,)](x, 7) == "ran"
    assert [s for _, _, s in fake.launches] == [4, 3, 2]
    fake.launches.clear()
    assert kern[(3,)](x, 7) == "ran"
    assert [s for _, _, s in fake.launches] == [2]  # no second round of failures
    # other input dtypes get their own trial
    fake.launches.clear()
    kern[(3,)](x.double(), 7)
    assert [s for _, _, s in fake.launches] == [4, 3, 2]


def test_out_of_resources_at_one_stage_is_raised(compiled_mode):
    fake = FakeKernel(fits=0)
    kern = tu.Tuned(fake, [triton.Config({"BK": 64}, num_warps=4, num_stages=2)], key=["n"])
    with pytest.raises(OutOfResources):
        kern[(1,)](torch.zeros(1), 1)
    assert [s for _, _, s in fake.launches] == [2, 1]


def test_pinned_config_is_clipped_and_grid_sees_it(compiled_mode):
    fake = FakeKernel(fits=3)
    kern = tu.Tuned(fake, [triton.Config({"BK": 64}, num_warps=4, num_stages=3)], key=["n"], clip={"BK": "n"})
    kern[lambda meta: (100 // meta["BK"],)](torch.zeros(1), 16)
    assert fake.launches == [((6,), 16, 3)]


def test_register_cap_is_passed_only_when_a_config_sets_one(compiled_mode):
    fake = FakeKernel(fits=3)
    for cap, seen in ((None, "absent"), (160, 160)):
        kern = tu.Tuned(fake, [triton.Config({"BK": 64}, num_warps=1, num_stages=1, maxnreg=cap)], key=["n"],
                        clip={"BK": "n"})
        kern[(1,)](torch.zeros(1), 32)  # clipping keeps the cap
        assert fake.caps[-1] == seen


def test_scan_value_block_follows_the_number_of_programs():
    from gdn2.ops.gdn2.chunk_fwd import bwd_scan_config, scan_config, state_scan_config

    def bv(pick, size, prec="tf32"):
        return pick(dict(SIZE=size, V=128, DOT_PREC=prec)).kwargs["BV"]

    # forward / backward scans: BV 64 down to 128 programs, then 32, else 16
    assert [bv(scan_config, s) for s in (128, 64, 32, 16, 8)] == [64, 64, 32, 16, 16]
    # the backward scan takes the whole value axis (8 warps) while that gives 128 programs
    assert [bv(bwd_scan_config, s) for s in (256, 128, 64, 32, 16, 8)] == [128, 128, 64, 32, 16, 16]
    assert bwd_scan_config(dict(SIZE=128, V=128, DOT_PREC="tf32")).num_warps == 8
    assert bv(bwd_scan_config, 128, "ieee") == 16
    # the state scan wants 256 programs
    assert [bv(state_scan_config, s) for s in (128, 64, 32, 16)] == [64, 32, 16, 16]
    # fp32 inputs (ieee products) always take the smallest tile
    assert bv(scan_config, 128, "ieee") == 16


def test_switches_are_read_at_launch_time(compiled_mode, ops_settings):
    """GDN2_SKIP_CONFIGS drops configs by index (never all of them); GDN2_AUTOTUNE=1 autotunes unless one
    config is left, a sweep pins one, or the interpreter runs the kernels; changing a switch after the
    kernel was defined takes effect."""
    fake = FakeKernel(fits=4)
    configs = [triton.Config({"BK": bk}, num_warps=4, num_stages=1) for bk in (64, 32, 16)]
    kern = tu.Tuned(fake, configs, key=["n"])
    assert kern.configs == configs and kern.direct
    ops_settings(skip_configs=frozenset({"fake_kernel:0", "other_kernel:1"}))
    assert kern.configs == configs[1:]
    kern[(1,)](torch.zeros(1), 64)
    assert fake.launches[-1][1] == 32  # the first config left
    ops_settings(skip_configs=frozenset({"fake_kernel:0", "fake_kernel:1", "fake_kernel:2"}))
    assert kern.configs == configs[:1]
    ops_settings(skip_configs=frozenset(), autotune=True)
    assert not kern.direct
    with kern.pinned(configs[2]):
        assert kern.direct
        kern[(1,)](torch.zeros(1), 8)
        assert fake.launches[-1][1] == 16
    assert not kern.direct
    ops_settings(interpret=True)
    assert kern.direct
