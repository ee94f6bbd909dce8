"""Model configuration: one dataclass, named configs stored as YAML in ``configs/`` (package data
``gdn2.configs``).

A named config file holds several sections (``model``, ``train``, ``data``, ...); this module reads the
``model`` section. The other sections belong to the trainer (``gdn2.train.recipe``).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

# The largest head dimension the Triton kernels take (GDN-2 key and value heads, attention heads).
MAX_HEAD_DIM = 256

# How finely a GDN-2 gate varies: one value per channel, or one per head broadcast over its channels.
GATE_GRANULARITIES = ("channel", "head")

# The named configs that ship with the package (the checkout's configs/ folder, installed as gdn2.configs).
PACKAGE_CONFIGS = Path(str(importlib.resources.files("gdn2.configs")))


def config_dirs() -> list[Path]:
    """Folders searched for named configs: ``$GDN2_CONFIG_DIR`` (os.pathsep separated), then the
    package's own (``configs/``)."""
    dirs = [Path(p) for p in os.environ.get("GDN2_CONFIG_DIR", "").split(os.pathsep) if p]
    return dirs + [PACKAGE_CONFIGS]


def known_config_names() -> list[str]:
    names: set[str] = set()
    for d in config_dirs():
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def find_config_file(name: str) -> Path:
    """Path of the YAML file for a named config, or of ``name`` itself when it is a YAML path."""
    as_path = Path(name)
    if as_path.suffix in (".yaml", ".yml"):
        if not as_path.is_file():
            raise FileNotFoundError(f"config file {name!r} does not exist")
        return as_path
    for d in config_dirs():
        p = d / f"{name}.yaml"
        if p.is_file():
            return p
    raise ValueError(f"unknown config name {name!r}; known names: {', '.join(known_config_names())}")


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a mapping that gives a key twice (PyYAML would keep the last value
    without a word: a config with ``lr`` twice would train on whichever came last). Keys brought in by
    a merge (``<<: *base``) may be overridden, as YAML means them to."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                earlier = first_line.get(key)
            except TypeError:  # an unhashable key: the constructor below reports it
                continue
            if earlier is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice (first at line {earlier})", key_node.start_mark)
            first_line[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: Path) -> dict[str, Any]:
    """A config file's sections; ValueError naming the file (and the line) for anything but a YAML
    mapping, a key given twice included."""
    try:
        with open(path) as f:
            data = yaml.load(f, Loader=UniqueKeyLoader)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{at}: {problem}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of sections at the top level, got {type(data).__name__}")
    return data


def check_type(value: Any, tp: Any, key: str) -> Any:
    """Validate (and lightly coerce: int -> float) ``value`` against a dataclass field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return check_type(value, a, key)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise TypeError(f"{key}: value {value!r} does not match {tp}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise TypeError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (inner, *_) = typing.get_args(tp) or (Any,)
        out = [check_type(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise TypeError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{key}: expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise TypeError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        raise TypeError(f"{key}: expected {tp.__name__}, got {type(value).__name__} {value!r}")
    return value


def dataclass_from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and wrong types raise naming ``where.key``."""
    if not isinstance(data, dict):
        raise TypeError(f"{where}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(names))}")
    kwargs = {k: check_type(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    return cls(**kwargs)


@dataclass
class Config:
    """Architecture of a GPT whose token mixers are GDN-2 and (sliding-window) attention layers.

    Layer ``i`` is a GDN-2 layer when ``gdn2_per_layer > 0 and i % gdn2_per_layer == 0``, otherwise an
    attention layer: sliding-window with ``sliding_window`` keys (query included) or full causal when
    ``sliding_window`` is null. ``gdn2_per_layer: 0`` gives a plain Transformer.
    """

    name: str = "custom"
    block_size: int = 4096
    vocab_size: int = 32000
    n_layer: int = 18
    n_embd: int = 2304
    # attention layers
    n_head: int = 18
    n_query_groups: Optional[int] = None  # KV heads (grouped-query attention); null = n_head
    head_size: Optional[int] = None  # null = n_embd // n_head
    sliding_window: Optional[int] = 2048  # keys seen by a query, itself included; null = full causal
    rope_base: float = 10000.0
    # MLP
    intermediate_size: int = 6784
    # normalisation
    norm_eps: float = 1e-5
    # GDN-2 layers
    gdn2_per_layer: int = 2
    gdn2_num_heads: int = 16
    gdn2_head_dim: int = 128
    gdn2_num_v_heads: Optional[int] = None  # grouped value heads; null = gdn2_num_heads
    gdn2_expand_v: float = 1.0
    gdn2_conv_size: int = 4
    gdn2_gate_rank: int = 128  # hidden size of the low-rank decay and output-gate projections
    allow_neg_eigval: bool = False
    # gate granularity: "channel" (one value per key / value channel) or "head" (one per head, broadcast
    # over its channels); tied: one per-head gate serves as both erase and write gate (KDA, Gated DeltaNet)
    gdn2_decay: str = "channel"
    gdn2_erase: str = "channel"
    gdn2_write: str = "channel"
    gdn2_tied_gates: bool = False
    # inference: GDN-2 layers use the recurrent kernel for inputs up to this many tokens
    gdn2_recurrent_max_len: int = 64

    def __post_init__(self) -> None:
        def need(cond: bool, key: str, msg: str) -> None:
            if not cond:
                raise ValueError(f"config {self.name!r}: model.{key} {msg}")

        for key in ("block_size", "vocab_size", "n_layer", "n_embd", "n_head", "intermediate_size",
                    "gdn2_num_heads", "gdn2_head_dim", "gdn2_conv_size", "gdn2_gate_rank"):
            need(getattr(self, key) > 0, key, f"must be positive, got {getattr(self, key)}")
        need(self.gdn2_per_layer >= 0, "gdn2_per_layer", f"must be >= 0, got {self.gdn2_per_layer}")
        need(self.norm_eps > 0, "norm_eps", f"must be positive, got {self.norm_eps}")
        need(self.rope_base > 1, "rope_base", f"must be greater than 1, got {self.rope_base}")
        if self.head_size is None:
            need(self.n_embd % self.n_head == 0, "n_head", f"must divide n_embd={self.n_embd}")
            self.head_size = self.n_embd // self.n_head
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        need(self.n_head % self.n_query_groups == 0, "n_query_groups",
             f"({self.n_query_groups}) must divide n_head ({self.n_head})")
        need(self.head_size % 2 == 0, "head_size", f"must be even for RoPE, got {self.head_size}")
        need(0 < self.head_size <= MAX_HEAD_DIM, "head_size",
             f"must be in [1, {MAX_HEAD_DIM}] (the attention kernels' largest head), got {self.head_size}")
        need(self.gdn2_head_dim <= MAX_HEAD_DIM, "gdn2_head_dim",
             f"must be at most {MAX_HEAD_DIM} (the GDN-2 kernels' largest head), got {self.gdn2_head_dim}")
        if self.sliding_window is not None:
            need(self.sliding_window >= 1, "sliding_window", f"must be >= 1 or null, got {self.sliding_window}")
        if self.gdn2_num_v_heads is None:
            self.gdn2_num_v_heads = self.gdn2_num_heads
        need(self.gdn2_num_v_heads % self.gdn2_num_heads == 0, "gdn2_num_v_heads",
             f"({self.gdn2_num_v_heads}) must be a multiple of gdn2_num_heads ({self.gdn2_num_heads})")
        v_dim = self.gdn2_head_dim * self.gdn2_expand_v
        need(v_dim == int(v_dim) and v_dim > 0, "gdn2_expand_v",
             f"times gdn2_head_dim must be a positive integer, got {v_dim}")
        need(v_dim <= MAX_HEAD_DIM, "gdn2_expand_v",
             f"times gdn2_head_dim must be at most {MAX_HEAD_DIM} (the GDN-2 kernels' largest value head), got {v_dim}")
        for key in ("gdn2_decay", "gdn2_erase", "gdn2_write"):
            need(getattr(self, key) in GATE_GRANULARITIES, key,
                 f"must be one of {', '.join(GATE_GRANULARITIES)}, got {getattr(self, key)!r}")
        need(not self.gdn2_tied_gates or self.gdn2_erase == self.gdn2_write == "head", "gdn2_tied_gates",
             f"needs gdn2_erase: head and gdn2_write: head (one gate per head serves as both; per channel they "
             f"cannot be one gate, the erase gate being over key channels and the write gate over value "
             f"channels), got gdn2_erase: {self.gdn2_erase}, gdn2_write: {self.gdn2_write}")

    # derived sizes -------------------------------------------------------------------------------
    @property
    def gdn2_head_v_dim(self) -> int:
        return int(self.gdn2_head_dim * self.gdn2_expand_v)

    @property
    def gdn2_key_dim(self) -> int:
        return self.gdn2_num_heads * self.gdn2_head_dim

    @property
    def gdn2_value_dim(self) -> int:
        return self.gdn2_num_v_heads * self.gdn2_head_v_dim

    @property
    def gdn2_decay_units(self) -> int:
        """Outputs of the decay's projection: one per key channel, or one per (key) head."""
        return self.gdn2_key_dim if self.gdn2_decay == "channel" else self.gdn2_num_heads

    @property
    def gdn2_erase_units(self) -> int:
        """Outputs of the erase gate's projection: one per key channel or per key head; a tied gate has one
        per value head (it is also the write gate)."""
        if self.gdn2_tied_gates:
            return self.gdn2_num_v_heads
        return self.gdn2_key_dim if self.gdn2_erase == "channel" else self.gdn2_num_heads

    @property
    def gdn2_write_units(self) -> int:
        """Outputs of the write gate's projection: one per value channel or per value head; none when tied."""
        if self.gdn2_tied_gates:
            return 0
        return self.gdn2_value_dim if self.gdn2_write == "channel" else self.gdn2_num_v_heads

    def is_gdn2_layer(self, i: int) -> bool:
        return self.gdn2_per_layer > 0 and i % self.gdn2_per_layer == 0

    @property
    def layer_kinds(self) -> list[str]:
        return ["gdn2" if self.is_gdn2_layer(i) else "attention" for i in range(self.n_layer)]

    # construction --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "model") -> "Config":
        return dataclass_from_dict(cls, data, where)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        """The ``model`` section of the named config (or of a YAML path), with overrides."""
        path = find_config_file(name)
        data = load_yaml(path)
        if "model" not in data:
            raise ValueError(f"{path}: no 'model' section")
        if not isinstance(data["model"] or {}, dict):
            raise TypeError(f"{path}: model: expected a mapping of architecture keys, got "
                            f"{type(data['model']).__name__} {data['model']!r}")
        model = dict(data["model"] or {})
        model.setdefault("name", path.stem)
        model.update(overrides)
        return cls.from_dict(model, where=f"{path}: model")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
