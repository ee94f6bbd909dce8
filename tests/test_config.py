from pathlib import Path

import pytest
import torch

from gdn2.config import PACKAGE_CONFIGS, Config, known_config_names
from gdn2.model import GPT, flops_per_token

README = Path(__file__).resolve().parent.parent / "README.md"
GATE_KEYS = ("gdn2_decay", "gdn2_erase", "gdn2_write", "gdn2_tied_gates")


def _meta_model(name):
    with torch.device("meta"):
        return GPT(Config.from_name(name))


def _readme_config_rows() -> dict[str, list[str]]:
    """The README's model-config table: config name -> the other cells of its row."""
    section = README.read_text().split("\n## Model configs\n")[1].split("\n## ")[0]
    rows = {}
    for line in section.splitlines():
        if line.startswith("| `"):
            name, *cells = (cell.strip() for cell in line.strip().strip("|").split("|"))
            rows[name.strip("`")] = cells
    return rows


def _table_row(name: str) -> list[str]:
    """A config's row as the README writes it, from the config and the model it builds."""
    c, m = Config.from_name(name), _meta_model(name)
    gdn = c.layer_kinds.count("gdn2")
    attention = c.n_layer - gdn
    if gdn == 0:
        gates = "-"
    elif c.gdn2_tied_gates:
        gates = f"{c.gdn2_decay} / tied {c.gdn2_erase}"
    else:
        gates = f"{c.gdn2_decay} / {c.gdn2_erase} / {c.gdn2_write}"
    window = "-" if attention == 0 else "full" if c.sliding_window is None else str(c.sliding_window)
    return [str(c.n_layer), str(c.n_embd), f"{gdn} / {attention}", gates, window, str(c.intermediate_size),
            str(c.vocab_size), str(c.block_size), f"{m.num_parameters(blocks_only=True):,}",
            f"{m.num_parameters():,}", f"{flops_per_token(c, c.block_size) / 1e9:.2f}"]


def test_readme_table_is_every_named_config_as_built():
    """One row per config of the package, each with the exact parameter counts and GFLOP/token."""
    rows = _readme_config_rows()
    assert sorted(rows) == sorted(p.stem for p in PACKAGE_CONFIGS.glob("*.yaml"))
    for name, cells in rows.items():
        assert cells == _table_row(name), name


KDA = dict(gdn2_decay="channel", gdn2_erase="head", gdn2_write="head", gdn2_tied_gates=True)
GATED_DELTANET = dict(KDA, gdn2_decay="head")
GATE_VARIANTS = {  # name: (the GDN-2 config it is sized against, its gates)
    **{f"{prefix}kda_{size}": (f"{prefix}gdn2_{size}", KDA)
       for prefix in ("", "swa_") for size in ("125M", "400M", "1.3B")},
    **{f"{prefix}gdn_{size}": (f"{prefix}gdn2_{size}", GATED_DELTANET)
       for prefix in ("", "swa_") for size in ("125M", "400M", "1.3B")},
    "gdn2_erase_head_125M": ("gdn2_125M", dict(gdn2_decay="channel", gdn2_erase="head", gdn2_write="channel",
                                               gdn2_tied_gates=False)),
    "gdn2_write_head_125M": ("gdn2_125M", dict(gdn2_decay="channel", gdn2_erase="channel", gdn2_write="head",
                                               gdn2_tied_gates=False)),
}


@pytest.mark.parametrize("name", sorted(GATE_VARIANTS))
def test_gate_variants_are_their_gdn2_config_with_other_gates_and_as_many_parameters(name):
    """Every key but the gates and the MLP as the GDN-2 config of the same kind and size (the recipe
    too), the MLP a multiple of 64, and blocks within 1% of its."""
    from gdn2.train.recipe import load_recipe

    reference, gates = GATE_VARIANTS[name]
    v, r = Config.from_name(name), Config.from_name(reference)
    assert {k: getattr(v, k) for k in GATE_KEYS} == gates
    differ = {"name", "intermediate_size", *GATE_KEYS}
    assert {k: x for k, x in v.to_dict().items() if k not in differ} == {
        k: x for k, x in r.to_dict().items() if k not in differ}
    assert v.intermediate_size % 64 == 0
    mine, theirs = load_recipe(name, {}).sections_dict(), load_recipe(reference, {}).sections_dict()
    assert {k: x for k, x in mine.items() if k != "model"} == {k: x for k, x in theirs.items() if k != "model"}
    blocks_v = _meta_model(name).num_parameters(blocks_only=True)
    blocks_r = _meta_model(reference).num_parameters(blocks_only=True)
    assert abs(blocks_v - blocks_r) / blocks_r < 0.01


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


def test_bad_gate_values_name_the_key(tmp_path):
    for key in ("gdn2_decay", "gdn2_erase", "gdn2_write"):
        with pytest.raises(ValueError, match=f"model.{key} must be one of channel, head, got 'scalar'"):
            Config(**{key: "scalar"})
    with pytest.raises(ValueError, match="model.gdn2_tied_gates needs gdn2_erase: head and gdn2_write: head.*"
                                         "got gdn2_erase: head, gdn2_write: channel"):
        Config(gdn2_erase="head", gdn2_tied_gates=True)
    p = tmp_path / "bad.yaml"
    p.write_text("model:\n  gdn2_tied_gates: yes please\n")
    with pytest.raises(TypeError, match="model.gdn2_tied_gates: expected true/false"):
        Config.from_name(str(p))
