"""The package stands on its own: installed from a wheel (not editable) and run outside the checkout, it
finds every named config and every task file, and every command answers --help; in the checkout, the
top-level folders' modules also run as scripts."""

import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# checkout folder -> the package it is installed as
INSTALLED_AS = {"gdn2": "gdn2", "configs": "gdn2/configs", "data_prep": "gdn2/data_prep", "eval": "gdn2/eval"}


def test_every_package_folder_is_listed_for_installation():
    """pyproject lists the packages one by one (the mapped folders are outside gdn2/): none is missed."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for folder, package in INSTALLED_AS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            found.add(".".join(Path(package).parts + init.parent.relative_to(ROOT / folder).parts))
    assert found == listed


@pytest.mark.slow
def test_wheel_install_outside_the_checkout(tmp_path):
    from gdn2.__main__ import COMMANDS

    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("gdn2-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    data = {f"gdn2/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    data |= {"gdn2/eval/" + str(p.relative_to(ROOT / "eval")) for p in (ROOT / "eval" / "tasks").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts}
    assert len(data) > 12 and data <= names, sorted(data - names)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GDN2_CONFIG_DIR")}
    env["PYTHONPATH"] = str(target)
    script = ("import gdn2; from gdn2.config import Config, known_config_names; "
              "from gdn2.eval.harness import LOCAL_TASKS; "
              "assert gdn2.__file__.startswith(%r), gdn2.__file__; "
              "names = known_config_names(); [Config.from_name(n) for n in names]; "
              "print(len(names), (LOCAL_TASKS / 'gdn2_local' / 'gdn2_local.yaml').is_file())" % str(target))
    out = subprocess.run([sys.executable, "-c", script], cwd=away, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(len(list((ROOT / "configs").glob("*.yaml")))), "True"]
    for command in COMMANDS:
        helped = subprocess.run([sys.executable, "-m", "gdn2", command, "--help"], cwd=away, env=env,
                                capture_output=True, text=True)
        assert helped.returncode == 0 and f"gdn2 {command}" in helped.stdout, (command, helped.stderr[-2000:])
        if command == "pretrain":
            assert "--train.global_batch_size" in helped.stdout and "--optimizer.lr" in helped.stdout


@pytest.mark.parametrize("script", ["data_prep/prepare.py", "data_prep/train_tokenizer.py",
                                    "data_prep/default_corpus.py", "eval/run.py", "eval/compare.py",
                                    "pretrain/main.py"])
def test_the_top_level_modules_run_as_scripts_in_the_checkout(script):
    out = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "usage" in out.stdout.lower(), out.stderr[-2000:]
