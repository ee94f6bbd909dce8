"""The Hugging Face bridge: an exported folder loads with AutoModelForCausalLM / AutoTokenizer where gdn2 is
not importable, gives gdn2's logits and tokens, generates with a real recurrent cache (cached equals
uncached, left padding honoured), runs under lm-eval's own hf model, and export -> import -> export is
lossless."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gdn2.checkpoint.load import load_model
from gdn2.config import Config
from gdn2.hf.convert import export, import_folder, main
from gdn2.model import GPT

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("swa_gdn2_tiny", "gdn2_tiny", "transformer_tiny", "kda_tiny", "gdn_tiny")
# Gated DeltaNet's tied gate over grouped value heads, doubled (a gate per value head, as b and w)
OVERRIDES = {"gdn_tiny": dict(gdn2_num_v_heads=8, allow_neg_eigval=True)}
TEXT = "the model learns a state\n\nwith gates and decay"

# Run where gdn2 cannot be imported: only transformers, torch and sentencepiece.
WITHOUT_GDN2 = """
import sys
sys.modules["gdn2"] = None
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

text, out = sys.argv[1], {}
for folder in sys.argv[3:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    ids = tok(text, return_tensors="pt").input_ids
    short = tok("the model", return_tensors="pt").input_ids
    greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=2)
    cached = model.generate(ids, use_cache=True, **greedy)
    uncached = model.generate(ids, use_cache=False, **greedy)
    pad = ids.shape[1] - short.shape[1]
    batch = torch.cat([torch.cat([torch.full((1, pad), 2), short], 1), ids])
    mask = torch.cat([torch.cat([torch.zeros(1, pad, dtype=torch.long), torch.ones_like(short)], 1),
                      torch.ones_like(ids)])
    together = model.generate(batch, attention_mask=mask, use_cache=True, **greedy)
    alone = model.generate(short, use_cache=True, **greedy)
    out[folder] = {"ids": ids[0].tolist(), "logits": model(ids).logits[0].tolist(), "cached": cached[0].tolist(),
                   "uncached": uncached[0].tolist(), "padded_row": together[0, pad:].tolist(),
                   "alone": alone[0].tolist(), "decoded": tok.decode(ids[0])}
torch.save(out, sys.argv[2])
"""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A consolidated checkpoint (model.pt + tokenizer.model) per tiny config, random weights."""
    from gdn2.data_prep.train_tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("gdn2_ckpt")
    words = "the model learns a state with gates and decay over tokens in every layer".split()
    sentences = [" ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 20)) + "\n" for i in range(1500)]
    tokenizer = train_tokenizer(sentences, root / "tokenizer.model", vocab_size=300, seed=1)
    found = {}
    for name in CONFIGS:
        window = 8 if name.startswith("swa") else None
        config = Config.from_name(name, vocab_size=300, block_size=64, sliding_window=window,
                                  **OVERRIDES.get(name, {}))
        torch.manual_seed(0)
        model = GPT(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(20.0)  # far from ties, so greedy choices are stable
        (root / name).mkdir()
        torch.save({"model": model.state_dict(), "config": config.to_dict(), "step": 7, "tokens": 700},
                   root / name / "model.pt")
        (root / name / "tokenizer.model").write_bytes(tokenizer.read_bytes())
        found[name] = root / name / "model.pt"
    return found


@pytest.fixture(scope="module")
def exported(checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: export(path, root / name) for name, path in checkpoints.items()}


@pytest.mark.slow
def test_loads_without_gdn2_with_its_logits_tokens_and_cache(checkpoints, exported, tmp_path):
    result = tmp_path / "result.pt"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_GDN2, TEXT, str(result), *map(str, exported.values())],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(result)
    for name, folder in exported.items():
        r = got[str(folder)]
        reference = load_model(checkpoints[name], device="cpu", dtype="float32")
        assert r["ids"] == reference.tokenizer.encode(TEXT) and r["decoded"] == TEXT
        with torch.no_grad():
            logits = reference.model(torch.tensor([r["ids"]]))[0]
        torch.testing.assert_close(torch.tensor(r["logits"]), logits, rtol=0, atol=1e-4)
        assert r["cached"] == r["uncached"], name  # the recurrent cache changes nothing
        alone = r["alone"]  # it may stop at EOS before the batch does, whose later tokens are then padding
        assert r["padded_row"][:len(alone)] == alone and set(r["padded_row"][len(alone):]) <= {2}, name
        assert len(r["cached"]) == len(r["ids"]) + 12


@pytest.mark.parametrize("name", ["swa_gdn2_tiny", "gdn_tiny"])
def test_export_import_export_is_lossless(checkpoints, exported, tmp_path, name):
    from safetensors.torch import load_file

    back = import_folder(exported[name], tmp_path / "imported")
    again = export(back, tmp_path / "again")
    first, second = (load_file(str(f / "model.safetensors")) for f in (exported[name], again))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
    strip = lambda f: {k: v for k, v in json.loads((f / "config.json").read_text()).items()  # noqa: E731
                       if k != "transformers_version"}
    assert strip(exported[name]) == strip(again) and strip(again)["gdn2_step"] == 7
    original = torch.load(checkpoints[name], weights_only=True)
    restored = torch.load(back, weights_only=True)
    assert restored["config"] == original["config"] and restored["step"] == 7
    assert all(torch.equal(restored["model"][k], v) for k, v in original["model"].items())


@pytest.mark.slow
def test_a_dev_install_loads_an_export_on_cpu_without_torchao_noise(exported, tmp_path):
    """torchao (float8's extra, not dev's) is imported by transformers' from_pretrained wherever it is
    installed, and on a CPU machine prints failed loads of its CUDA libraries and deprecation warnings."""
    import importlib.util
    import re
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {extra: {re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower() for req in reqs}
             for extra, reqs in extras.items()}
    assert "torchao" not in names["dev"] and "torchao" in names["float8"]
    if importlib.util.find_spec("torchao") is not None:
        pytest.skip("torchao is installed here (the float8 extra)")
    load = ("import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True); "
            "AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)")
    proc = subprocess.run([sys.executable, "-c", load, str(exported["swa_gdn2_tiny"])], capture_output=True,
                          text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    noise = [line for line in proc.stderr.splitlines() if "torchao" in line or "deprecated" in line.lower()]
    assert not noise, noise


def test_the_exported_tokenizer_pads_a_batch_with_the_generation_configs_pad_id(exported):
    from transformers import AutoTokenizer, GenerationConfig

    folder = exported["swa_gdn2_tiny"]
    tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    pad = GenerationConfig.from_pretrained(folder).pad_token_id
    batch = tok(["the model", TEXT], padding=True, return_tensors="pt")
    short = tok("the model").input_ids
    assert tok.pad_token_id == pad == tok.eos_token_id
    width = batch.input_ids.shape[1]
    assert batch.input_ids[0].tolist() == [pad] * (width - len(short)) + short  # on the left, for generation
    assert batch.attention_mask[0].tolist() == [0] * (width - len(short)) + [1] * len(short)


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_folder_with_gdn2s_tasks(exported, tmp_path):
    """lm-eval's own command line and ``hf`` model on an export, gdn2's task folder given as its
    --include_path by ``gdn2 eval --print_include_path`` (as the README's command does)."""
    found = subprocess.run([sys.executable, "-m", "gdn2", "eval", "--print_include_path"], capture_output=True,
                           text=True, cwd=tmp_path, timeout=120)
    assert found.returncode == 0, found.stderr
    include = found.stdout.strip()
    assert (Path(include) / "gdn2_local" / "gdn2_local_mc.yaml").is_file()
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
         f"pretrained={exported['swa_gdn2_tiny']},trust_remote_code=True,dtype=float32", "--tasks",
         "gdn2_local_mc,gdn2_local_gen", "--include_path", include, "--device", "cpu", "--batch_size", "2",
         "--limit", "2", "--output_path", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = (tmp_path / "out").rglob("results_*.json")
    results = json.loads(path.read_text())["results"]
    assert 0.0 <= results["gdn2_local_mc"]["acc,none"] <= 1.0
    assert "exact_match,strip" in results["gdn2_local_gen"]


def test_import_refuses_what_export_did_not_write(tmp_path, capsys):
    from gdn2.commandline import run

    (tmp_path / "bert").mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.model"):
        (tmp_path / "bert" / name).write_text("{}" if name == "config.json" else "")
    (tmp_path / "bert" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert run(main, ["import", "--model", str(tmp_path / "bert"), "--out", str(tmp_path / "o")], "gdn2 hf") == 2
    assert "model_type 'bert', not a gdn2 model" in capsys.readouterr().err


def hf_command(capsys, *argv):
    """(exit status, stderr) of ``gdn2 hf ARGV``."""
    from gdn2.commandline import run

    status = run(main, [str(a) for a in argv], "gdn2 hf")
    return status, capsys.readouterr().err.strip()


def files_of(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_export_takes_a_new_or_empty_folder_or_replaces_an_earlier_export_when_told(checkpoints, exported,
                                                                                     tmp_path, capsys):
    from safetensors.torch import load_file

    source = checkpoints["swa_gdn2_tiny"]
    status, line = hf_command(capsys, "export", "--checkpoint", source, "--out", source.parent, "--overwrite")
    assert status == 2 and f"--out {source.parent} holds the checkpoint being exported" in line
    assert sorted(p.name for p in source.parent.iterdir()) == ["model.pt", "tokenizer.model"]

    target = shutil.copytree(exported["swa_gdn2_tiny"], tmp_path / "hf")
    status, line = hf_command(capsys, "export", "--checkpoint", source, "--out", target, "--dtype", "bfloat16")
    assert status == 2 and f"--out {target} is not empty; pass --overwrite" in line
    assert load_file(str(target / "model.safetensors"))["lm_head.weight"].dtype == torch.float32
    assert hf_command(capsys, "export", "--checkpoint", source, "--out", target, "--dtype", "bfloat16",
                      "--overwrite")[0] == 0
    assert load_file(str(target / "model.safetensors"))["lm_head.weight"].dtype == torch.bfloat16

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    status, line = hf_command(capsys, "export", "--checkpoint", source, "--out", tmp_path / "notes", "--overwrite")
    assert status == 2 and "notes holds files that are not a gdn2 export" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "notes"]  # nothing hidden left behind


def test_a_failed_reexport_leaves_the_earlier_export_whole(checkpoints, tmp_path, small_disk, capsys):
    """Re-exporting in float32 over a bfloat16 export on a disk with room for one of each fails for want of
    space: one line naming the disk, and the earlier export as it was (it used to get the new config.json
    over its old weights, which import then accepted)."""
    disk = small_disk("5m")
    target = export(checkpoints["swa_gdn2_tiny"], disk / "hf", dtype="bfloat16")
    before = files_of(target)
    status, line = hf_command(capsys, "export", "--checkpoint", checkpoints["swa_gdn2_tiny"], "--out", target,
                              "--overwrite")
    assert status == 2 and len(line.splitlines()) == 1
    assert f"No space left on device on the disk mounted at {disk} while writing {target}" in line
    assert "the earlier export there is untouched" in line
    assert files_of(target) == before and [p.name for p in disk.iterdir()] == ["hf"]
    import_folder(target, tmp_path / "back")


SIGTERM_WHILE_EXPORTING = """
import pathlib, sys, time
import safetensors.torch

write_weights = safetensors.torch.save_file

def write_then_wait(*args, **kwargs):  # a large model takes its time here
    write_weights(*args, **kwargs)
    pathlib.Path(sys.argv[3]).touch()
    time.sleep(300)

safetensors.torch.save_file = write_then_wait
from gdn2.commandline import run
from gdn2.hf.convert import main
sys.exit(run(main, ["export", "--checkpoint", sys.argv[1], "--out", sys.argv[2], "--overwrite"], "gdn2 hf"))
"""


@pytest.mark.slow
def test_sigterm_during_an_export_leaves_the_earlier_export_and_no_hidden_file(checkpoints, exported, tmp_path):
    target = shutil.copytree(exported["swa_gdn2_tiny"], tmp_path / "hf")
    before = files_of(target)
    writing = tmp_path / "writing"
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_WHILE_EXPORTING, str(checkpoints["transformer_tiny"]),
                             str(target), str(writing)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not writing.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "timeout"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert files_of(target) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "writing"]


def test_import_checks_the_weights_against_config_json_naming_file_and_key(exported, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    def variant(tag, config=None, weights=None):
        folder = shutil.copytree(exported["swa_gdn2_tiny"], tmp_path / tag)
        if config:
            (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                             **config}))
        if weights:
            weights(folder / "model.safetensors")
        return folder

    def drop_one(path):
        state = load_file(str(path))
        del state["transformer.h.1.mlp.w2.weight"]
        save_file(state, str(path))

    cases = [
        (variant("typed", config={"n_layer": "4"}), r"typed/config.json.n_layer: expected an integer, got str '4'"),
        (variant("wider", config={"intermediate_size": 512}),
         r"wider/model.safetensors: transformer.h.0.mlp.w1.weight has shape \[384, 128\], config.json calls for "
         r"\[512, 128\]"),
        (variant("short", weights=drop_one), r"short/model.safetensors: transformer.h.1.mlp.w2.weight is missing"),
        (variant("cut", weights=lambda p: p.write_bytes(p.read_bytes()[:100_000])),
         r"cut/model.safetensors: not a readable safetensors file"),
    ]
    for folder, expected in cases:
        status, line = hf_command(capsys, "import", "--model", folder, "--out", tmp_path / "out")
        assert status == 2 and re.search(expected, line), (expected, line)
    assert not (tmp_path / "out").exists()
