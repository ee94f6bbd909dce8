import pytest
import torch

from gdn2.config import Config, known_config_names
from gdn2.model import GPT

EXPECTED = {  # blocks only, total
    "gdn2_1.3B": (1_302_638_112, 1_450_096_416),
    "swa_gdn2_1.3B": (1_300_314_384, 1_447_772_688),
}


def _meta_model(name):
    with torch.device("meta"):
        return GPT(Config.from_name(name))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_reference_parameter_counts(name):
    m = _meta_model(name)
    assert (m.num_parameters(blocks_only=True), m.num_parameters()) == EXPECTED[name]


def test_mixer_parameter_counts():
    m = _meta_model("swa_gdn2_1.3B")
    gdn, swa = m.transformer.h[0].mixer, m.transformer.h[1].mixer
    assert sum(p.numel() for p in gdn.parameters()) == 29_454_480
    assert sum(p.numel() for p in swa.parameters()) == 21_233_664


def test_interleave_rule():
    c = Config.from_name("swa_gdn2_1.3B")
    assert c.layer_kinds == ["gdn2", "attention"] * 9
    assert set(Config.from_name("gdn2_1.3B").layer_kinds) == {"gdn2"}
    assert set(Config.from_name("transformer_1.3B").layer_kinds) == {"attention"}


@pytest.mark.parametrize("size", ["125M", "400M", "1.3B"])
def test_transformer_baseline_matches_the_hybrid(size):
    """Same width, depth, heads, vocabulary and context; blocks within 1% of the hybrid's."""
    t, h = Config.from_name(f"transformer_{size}"), Config.from_name(f"swa_gdn2_{size}")
    assert set(t.layer_kinds) == {"attention"} and t.sliding_window is None
    for key in ("n_layer", "n_embd", "n_head", "n_query_groups", "head_size", "vocab_size", "block_size"):
        assert getattr(t, key) == getattr(h, key), key
    blocks_t = _meta_model(f"transformer_{size}").num_parameters(blocks_only=True)
    blocks_h = _meta_model(f"swa_gdn2_{size}").num_parameters(blocks_only=True)
    assert abs(blocks_t - blocks_h) / blocks_h < 0.01


def test_every_named_config_builds():
    names = known_config_names()
    assert {"gdn2_1.3B", "swa_gdn2_1.3B", "transformer_1.3B", "swa_gdn2_tiny", "gdn2_tiny"} <= set(names)
    for n in names:
        _meta_model(n)


def test_unknown_name_lists_known_names():
    with pytest.raises(ValueError, match="unknown config name 'nope'.*swa_gdn2_1.3B"):
        Config.from_name("nope")


def test_unknown_key_and_wrong_type_name_the_key(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  n_layer: 2\n  n_embdd: 64\n")
    with pytest.raises(ValueError, match="n_embdd"):
        Config.from_name(str(p))
    p.write_text("model:\n  n_layer: two\n")
    with pytest.raises(TypeError, match="model.n_layer"):
        Config.from_name(str(p))
    p.write_text("model:\n  sliding_window: 1.5\n")
    with pytest.raises(TypeError, match="sliding_window"):
        Config.from_name(str(p))


def test_a_key_given_twice_names_the_file_line_and_key(tmp_path):
    """YAML would keep the last of two values without a word; a merge key (<<) may still be overridden."""
    p = tmp_path / "twice.yaml"
    p.write_text("model:\n  n_layer: 2\n  n_embd: 64\n  n_layer: 4\n")
    with pytest.raises(ValueError, match=r"twice.yaml: not valid YAML at line 4, column 3: key 'n_layer' given twice "
                                         r"\(first at line 2\)"):
        Config.from_name(str(p))
    p.write_text("base: &base {n_layer: 2, n_embd: 64, n_head: 2}\nmodel:\n  <<: *base\n  n_layer: 4\n")
    assert Config.from_name(str(p)).n_layer == 4


def test_inconsistent_values_rejected():
    with pytest.raises(ValueError, match="gdn2_num_v_heads"):
        Config(gdn2_num_heads=4, gdn2_num_v_heads=6)
    with pytest.raises(ValueError, match="n_query_groups"):
        Config(n_head=18, n_query_groups=4)
