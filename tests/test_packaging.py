"""The package stands on its own: installed from a wheel (not editable) and run outside the checkout,
it finds its named configs and local lm-eval tasks, and its command line works."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_wheel_install_outside_the_checkout(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(ROOT)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("gdn2-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"gdn2/configs/swa_gdn2_1.3B.yaml", "eval/tasks/gdn2_local/gdn2_local.yaml",
            "eval/tasks/gdn2_local/local_data.py",
            "eval/tasks/gdn2_local/data/mc.jsonl"} <= names
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GDN2_CONFIG_DIR")}
    env["PYTHONPATH"] = str(target)
    script = ("import gdn2, gdn2.eval as e; from gdn2.config import Config; "
              "assert gdn2.__file__.startswith(%r), gdn2.__file__; "
              "print(Config.from_name('swa_gdn2_1.3B').n_layer, (e.LOCAL_TASKS / 'gdn2_local' / 'gdn2_local.yaml').is_file())"
              % str(target))
    out = subprocess.run([sys.executable, "-c", script], cwd=away, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["18", "True"], out.stderr[-2000:]
    helped = subprocess.run([sys.executable, "-m", "gdn2", "pretrain", "--help"], cwd=away, env=env,
                            capture_output=True, text=True)
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert "--train.global_batch_size" in helped.stdout and "--optimizer.lr" in helped.stdout
