"""gdn2/eval/run.py: python -m gdn2 eval writes its results by the step of the checkpoint scored."""

import json
import shutil

import pytest
import torch


@pytest.mark.slow
def test_eval_run_names_the_step_and_keeps_earlier_results(artifacts, tmp_path):
    from gdn2.eval import run

    folder, _, _ = artifacts
    for step in (7, 9):
        (tmp_path / f"step{step}").mkdir()
        shutil.copy(folder / "tokenizer.model", tmp_path / f"step{step}")
        torch.save(dict(torch.load(folder / "model.pt", weights_only=False), step=step),
                   tmp_path / f"step{step}" / "model.pt")
    out = tmp_path / "out"
    common = ["--limit", "3", "--batch_size", "4", "--device", "cpu", "--output", str(out)]
    for step, tasks in ((7, "gdn2_local_mc"), (7, "gdn2_local_ppl"), (9, "gdn2_local_mc")):
        assert run.main(["--checkpoint", str(tmp_path / f"step{step}" / "model.pt"), "--tasks", tasks, *common]) == 0
    seven = json.loads((out / "results-step-000000007.json").read_text())
    assert seven["step"] == 7 and seven["tasks"] == ["gdn2_local_mc", "gdn2_local_ppl"]  # the second run added
    assert set(seven["summary"]) >= {"gdn2_local_mc/acc", "gdn2_local_ppl/word_perplexity"}
    assert seven["config"]["vocab_size"] == 512 and seven["limit"] == 3
    table = (out / "results-step-000000007.md").read_text()
    assert "step 7" in table.splitlines()[0]
    assert "| gdn2_local_mc | acc |" in table and "| gdn2_local_ppl | word_perplexity |" in table
    nine = json.loads((out / "results-step-000000009.json").read_text())
    assert nine["step"] == 9 and set(nine["summary"]) == {k for k in seven["summary"] if k.startswith("gdn2_local_mc/")}
    with pytest.raises(ValueError, match="--tasks: unknown task.*no_such_task"):
        run.main(["--checkpoint", str(folder / "model.pt"), "--tasks", "no_such_task", *common])


def test_checkpoint_and_tasks_are_required_unless_the_include_path_is_asked(capsys):
    from gdn2.commandline import run
    from gdn2.eval import LOCAL_TASKS
    from gdn2.eval.run import main

    assert run(main, ["--print_include_path"], "gdn2 eval") == 0
    assert capsys.readouterr().out == f"{LOCAL_TASKS}\n"
    for argv, missing in ((["--tasks", "gdn2_local"], "--checkpoint"), (["--checkpoint", "x.pt"], "--tasks")):
        assert run(main, argv, "gdn2 eval") == 2
        assert f"{missing} is required" in capsys.readouterr().err
