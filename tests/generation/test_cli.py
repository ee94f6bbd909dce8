"""gdn2/generation/cli.py: ``python -m gdn2 generate`` and its flags."""

import pytest

import gdn2.generation.cli as cli
from gdn2.commandline import run
from decode_helpers import tiny_decoding_model


def test_the_command_line_runs_generate(capsys):
    from gdn2.__main__ import main

    assert main(["generate", "--help"]) == 0 and "--checkpoint" in capsys.readouterr().out


def test_flags_reach_the_generator(monkeypatch):
    model = tiny_decoding_model("gdn2_tiny")
    seen = {}

    class Recorder:
        def __init__(self, *args, **kwargs):
            seen.update(kwargs)
            raise SystemExit(0)

    monkeypatch.setattr(cli, "Generator", Recorder)
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: type("L", (), {"model": model, "tokenizer": None})())
    for argv, expected in ((["--no_compile", "--no_fused"], (False, False)), (["--compile"], (True, True)),
                           ([], (None, True)), (["--no-compile"], (False, True))):  # the dashed spelling too
        seen.clear()
        with pytest.raises(SystemExit):
            run(cli.main, ["--checkpoint", "x", "--prompt", "p"] + argv, "gdn2 generate")
        assert (seen["compile"], seen["fused"]) == expected
