"""gdn2/generation/cli.py: ``python -m gdn2.generation`` and its flags."""

import runpy
import sys

import pytest

import gdn2.generation.cli as cli
from decode_helpers import tiny_decoding_model


def test_module_runs_the_command_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gdn2.generation", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("gdn2.generation", run_name="__main__")
    assert exit_.value.code == 0 and "--checkpoint" in capsys.readouterr().out


def test_flags_reach_the_generator(monkeypatch):
    model = tiny_decoding_model("gdn2_tiny")
    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            raise SystemExit(0)

    monkeypatch.setattr(cli, "Generator", Recorder)
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: type("L", (), {"model": model, "tokenizer": None})())
    for argv, expected in ((["--no-compile", "--no-fused"], (False, False)), (["--compile"], (True, True)),
                           ([], (None, True))):
        seen.clear()
        with pytest.raises(SystemExit):
            cli.main(["--checkpoint", "x", "--prompt", "p"] + argv)
        assert (seen["compile"], seen["fused"]) == expected
