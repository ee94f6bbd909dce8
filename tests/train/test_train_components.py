"""Schedule, optimizer groups, MFU peaks, the resume check of a checkpoint's model config."""

import json
import math

import pytest
import torch

from gdn2.config import Config
from gdn2.model import GPT
from gdn2.train.metrics import model_flops_utilization, peak_bf16_flops
from gdn2.checkpoint.format import bare_parameter_name
from gdn2.train.optimizer import build_optimizer, no_weight_decay_names, parameter_groups
from gdn2.train.recipe import OptimizerConfig, load_recipe
from gdn2.train.setup import check_resume_compatible
from gdn2.train.schedule import cosine_with_warmup

from train_helpers import MICRO_MODEL


def test_cosine_with_warmup_shape():
    lr = lambda s: cosine_with_warmup(s, max_lr=4e-4, warmup_steps=10, total_steps=110, min_lr=4e-5)  # noqa: E731
    assert lr(0) == pytest.approx(4e-5)
    assert lr(9) == pytest.approx(4e-4)  # warmup ends at the peak
    assert lr(10) == pytest.approx(4e-4)
    assert lr(60) == pytest.approx((4e-4 + 4e-5) / 2)  # half way down the cosine
    assert lr(110) == pytest.approx(4e-5) and lr(500) == pytest.approx(4e-5)
    values = [lr(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert cosine_with_warmup(0, 1.0, 0, 10, 0.0) == 1.0
    with pytest.raises(ValueError, match="warmup_steps"):
        cosine_with_warmup(0, 1.0, 11, 10, 0.0)


def test_no_decay_on_gates_norms_and_biases():
    model = GPT(Config(**MICRO_MODEL))
    exempt = no_weight_decay_names(model)
    names = dict(model.named_parameters())
    assert any(n.endswith("A_log") for n in exempt) and any(n.endswith("dt_bias") for n in exempt)
    assert any("norm" in n for n in exempt) and any(n.endswith(".bias") for n in exempt)
    for n in exempt:
        assert names[n].ndim < 2 or getattr(names[n], "_no_weight_decay", False)
    assert "transformer.wte.weight" not in exempt and "lm_head.weight" not in exempt

    opt = build_optimizer(model, exempt, OptimizerConfig(weight_decay=0.1), "cpu")
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert {id(p) for p in no_decay["params"]} == {id(names[n]) for n in exempt}
    assert len(decay["params"]) + len(no_decay["params"]) == len(names)
    # the reference's behaviour: the same groups, decay everywhere
    opt = build_optimizer(model, exempt, OptimizerConfig(weight_decay=0.1, decay_all=True), "cpu")
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.1]


def test_wrapped_names_map_back():
    assert bare_parameter_name("_forward_module._fsdp_wrapped_module.transformer.h.0._fsdp_wrapped_module."
                                "_checkpoint_wrapped_module.mixer.A_log") == "transformer.h.0.mixer.A_log"
    assert bare_parameter_name("module.lm_head.weight") == "lm_head.weight"
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="not found"):
        parameter_groups([("a", p)], {"b"}, 0.1)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA H20", 148e12), ("NVIDIA GH200 480GB", 989e12), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA A10G", None), ("Tesla V100-SXM2-32GB", None),
])
def test_peak_flops_table(name, peak):
    assert peak_bf16_flops(name) == peak


def test_mfu():
    assert model_flops_utilization(9e9, 38_000, 989e12) == pytest.approx(9e9 * 38_000 / 989e12)
    assert model_flops_utilization(9e9, 38_000, None) is None
    assert math.isclose(model_flops_utilization(1e12, 989, 989e12), 1.0)


def test_a_checkpoint_from_before_a_model_key_existed_resumes_as_its_default(tmp_path):
    """A checkpoint whose model config lacks the gate keys (saved before they existed) is today's GDN-2:
    it resumes under the defaults, and not under other gates."""
    import yaml

    from gdn2.checkpoint.format import CONFIG, MARKER

    recipe = load_recipe("gdn2_tiny")
    sections = recipe.sections_dict()
    for key in ("gdn2_decay", "gdn2_erase", "gdn2_write", "gdn2_tied_gates"):
        del sections["model"][key]
    checkpoint = tmp_path / "step-000000001"
    checkpoint.mkdir()
    (checkpoint / CONFIG).write_text(yaml.safe_dump(sections))
    (checkpoint / MARKER).write_text(json.dumps({"step": 1, "world_size": 1}))
    assert check_resume_compatible(recipe, checkpoint, 1) == []
    with pytest.raises(ValueError, match="model.gdn2_erase: checkpoint 'channel', now 'head'"):
        check_resume_compatible(load_recipe("gdn2_tiny", {"model.gdn2_erase": "head"}), checkpoint, 1)


@pytest.mark.parametrize("cores, local_ranks, workers, env, busy, expected", [
    (2, 1, 0, {}, 0.1, 2),  # an idle small machine: both cores
    (2, 1, 0, {}, 7.5, 1),  # a busy one: one thread, whatever the load beyond the cores
    (16, 1, 0, {}, 3.4, 13),  # the cores other work does not keep busy
    (16, 2, 2, {}, 0.0, 6),  # 16 // 2 ranks, less each rank's 2 loader workers
    (4, 8, 0, {}, 0.0, 1),  # more ranks than cores: one thread each
    (8, 1, 16, {}, 0.0, 1),
    (1, 1, 0, {}, 0.0, 1),  # never more than the cores
    (64, 1, 0, {"OMP_NUM_THREADS": "4"}, 0.0, None),  # an explicit setting is torch's to follow
    (64, 1, 0, {"OMP_NUM_THREADS": ""}, 0.0, 64),
])
def test_cpu_threads_per_rank(cores, local_ranks, workers, env, busy, expected):
    from gdn2.train.setup import cpu_threads

    assert cpu_threads(cores, local_ranks, workers, env, busy) == expected


def test_cgroup_cpu_quota_caps_the_usable_cores(tmp_path):
    from gdn2.train.setup import cgroup_cpu_quota

    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("250000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 3  # v1, rounded up
    (tmp_path / "cpu.max").write_text("200000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2  # v2 first
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
