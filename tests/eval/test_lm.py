"""The lm-eval adapter (gdn2/eval/lm.py) against direct computations from the model's logits; checkpoints it loads."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from lm_eval.api.instance import Instance
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import gdn2.eval.lm  # noqa: F401  registers "gdn2"
from gdn2.eval.lm import GDN2LM
from decode_helpers import greedy_by_full_forward

from tiny_checkpoint import MAX_LENGTH, TASK_DATA


def _requests(kind, args_list):
    return [Instance(request_type=kind, doc={}, arguments=args, idx=i) for i, args in enumerate(args_list)]


def _direct_logprob(model, ids, n_cont):
    """Sum of log p of the last n_cont tokens of ids, each from the logits of the position before it."""
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), dim=-1)
    targets = torch.tensor(ids[1:])
    picked = logp.gather(-1, targets[:, None])[:, 0][-n_cont:]
    greedy = bool((logp.argmax(-1) == targets)[-n_cont:].all())
    return float(picked.sum()), greedy


LONG_CONTEXT = " ".join(json.loads(line)["text"] for line in
                        (TASK_DATA / "ppl.jsonl").read_text().splitlines()[:2])


def test_loglikelihood_equals_sum_of_token_logprobs(lm, artifacts):
    _, tok, _ = artifacts
    pairs = [("The river starts as a thin", " stream"), ("A good loaf of bread needs", " only flour, water and salt"),
             ("", "Bees make honey."), ("Question: Which animal can fly?\nAnswer:", " a sparrow"),
             (LONG_CONTEXT, " And then it rained."), ("The opposite of hot is ", "cold")]
    got = lm.loglikelihood(_requests("loglikelihood", pairs))
    eos = tok.eos_id
    for (ctx, cont), (score, greedy) in zip(pairs, got):
        if ctx:
            # trailing spaces of the context belong to the continuation; EOS marks the document start
            stripped = ctx.rstrip()
            cont = ctx[len(stripped):] + cont
            whole, ctx_ids = tok.encode(stripped + cont), tok.encode(stripped)
            ids, n_cont = [eos] + whole, len(whole) - len(ctx_ids)
        else:
            ids, n_cont = [eos] + tok.encode(cont), len(tok.encode(cont))
        ids = ids[-(MAX_LENGTH + 1):]  # the long context is cut to the model's window
        expected, expected_greedy = _direct_logprob(lm.model, ids, n_cont)
        assert score == pytest.approx(expected, abs=1e-9)
        assert greedy == expected_greedy
    assert len(tok.encode(LONG_CONTEXT)) > 2 * MAX_LENGTH


def test_loglikelihood_rolling_scores_every_token_once(lm, artifacts, monkeypatch):
    _, tok, _ = artifacts
    texts = [LONG_CONTEXT, "Short text.", ""]
    seen = []
    real = GDN2LM._loglikelihood_tokens

    def spy(self, requests, **kw):
        seen.extend(requests)
        return real(self, requests, **kw)

    monkeypatch.setattr(GDN2LM, "_loglikelihood_tokens", spy)
    got = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(t,) for t in texts]))
    tokens = tok.encode(LONG_CONTEXT)
    assert len(tokens) > 3 * MAX_LENGTH
    # the windows of the long text: continuations tile its tokens exactly once, in order
    long_windows = [w for w in seen if w[2] and len(w[2]) + len(w[1]) > 1][: -1]
    scored = [t for _, _, cont in seen for t in cont]
    assert len(scored) == len(tokens) + len(tok.encode("Short text."))
    assert scored[: len(tokens)] == tokens
    assert all(len(ctx) + len(cont) - 1 <= MAX_LENGTH for _, ctx, cont in seen)
    assert long_windows
    # value: each window scored on its own with a plain forward pass
    expected = 0.0
    for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(tokens, tok.eos_id, MAX_LENGTH, 1)):
        expected += _direct_logprob(lm.model, ctx + cont, len(cont))[0]
    assert got[0] == pytest.approx(expected, abs=1e-9)
    short = [tok.eos_id] + tok.encode("Short text.")
    assert got[1] == pytest.approx(_direct_logprob(lm.model, short, len(short) - 1)[0], abs=1e-9)
    assert got[2] == 0.0


def test_rolling_within_max_length_equals_one_forward_pass(artifacts):
    folder, tok, _ = artifacts
    long_lm = GDN2LM(checkpoint=str(folder / "model.pt"), dtype="float64", device="cpu", batch_size=2,
                     max_length=512)
    (got,) = long_lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(LONG_CONTEXT,)]))
    ids = [tok.eos_id] + tok.encode(LONG_CONTEXT)
    assert got == pytest.approx(_direct_logprob(long_lm.model, ids, len(ids) - 1)[0], abs=1e-9)


def test_generate_until_is_greedy_and_batching_changes_nothing(lm, artifacts):
    folder, tok, _ = artifacts
    contexts = ["The river", "Once upon a time, in a small village by the sea, there lived", "A", "Bees make"]
    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": 6, "do_sample": False}
    batched = lm.generate_until(_requests("generate_until", [(c, gen_kwargs) for c in contexts]))
    for c, text in zip(contexts, batched):
        ids = greedy_by_full_forward(lm.model, [tok.eos_id] + tok.encode(c), 6)
        if tok.eos_id in ids:
            ids = ids[: ids.index(tok.eos_id)]
        expected = tok.decode(ids)
        assert text == expected[: expected.find("\n\n")] if "\n\n" in expected else text == expected
    single = GDN2LM(checkpoint=str(folder / "model.pt"), dtype="float64", device="cpu", batch_size=1)
    assert single.generate_until(_requests("generate_until", [(c, gen_kwargs) for c in contexts])) == batched


def test_missing_pieces_are_named(artifacts, tmp_path):
    folder, _, _ = artifacts
    with pytest.raises(FileNotFoundError, match="checkpoint .*nothing.pt.* does not exist"):
        GDN2LM(checkpoint=str(tmp_path / "nothing.pt"), device="cpu")
    # a bare state dict with no config anywhere near it
    bare = tmp_path / "bare"
    bare.mkdir()
    torch.save(torch.load(folder / "model.pt", weights_only=True)["model"], bare / "weights.pt")
    shutil.copy(folder / "tokenizer.model", bare / "tokenizer.model")
    with pytest.raises(ValueError, match="config missing"):
        GDN2LM(checkpoint=str(bare / "weights.pt"), device="cpu")
    # config inside the file, but no tokenizer beside it
    lonely = tmp_path / "a" / "b" / "c"
    lonely.mkdir(parents=True)
    shutil.copy(folder / "model.pt", lonely / "model.pt")
    with pytest.raises(FileNotFoundError, match="tokenizer missing"):
        GDN2LM(checkpoint=str(lonely / "model.pt"), device="cpu")
    # an explicit tokenizer that does not exist
    with pytest.raises(FileNotFoundError, match="tokenizer .*absent.model"):
        GDN2LM(checkpoint=str(folder / "model.pt"), tokenizer=str(tmp_path / "absent.model"), device="cpu")
    # a config name that does not exist
    with pytest.raises(ValueError, match="unknown config name"):
        GDN2LM(checkpoint=str(bare / "weights.pt"), config="no_such_config", device="cpu")
    # a config that does not match the weights
    with pytest.raises(ValueError, match="does not match config"):
        GDN2LM(checkpoint=str(bare / "weights.pt"), config="gdn2_tiny", device="cpu")


@pytest.mark.parametrize("layout", ["full", "sharded"])
def test_training_checkpoint_folder_and_tokenizer_from_its_data(artifacts, tmp_path, monkeypatch, layout):
    """A trainer's step-<N> folder (state + config.yaml + COMPLETE): weights through the trainer's
    consolidation, config from config.yaml, tokenizer from the data folder the run trained on."""
    import yaml

    folder, tok, cfg = artifacts
    state = torch.load(folder / "model.pt", weights_only=True)["model"]
    data = tmp_path / "data" / "corpus"
    data.mkdir(parents=True)
    shutil.copy(folder / "tokenizer.model", data / "tokenizer.model")
    step = tmp_path / "run" / "checkpoints" / "step-000000020"
    step.mkdir(parents=True)
    if layout == "full":
        torch.save({"model": {f"_forward_module.{k}": v for k, v in state.items()}, "trainer": {"step": 20}},
                   step / "state")
    else:
        from torch.distributed.checkpoint import FileSystemWriter, save

        save({"model": dict(state)}, storage_writer=FileSystemWriter(str(step / "state")), no_dist=True)
    (step / "config.yaml").write_text(yaml.safe_dump({"model": cfg.to_dict(), "data": {"train": ["data/corpus"]}}))
    (step / "COMPLETE").write_text(json.dumps({"step": 20, "world_size": 1, "tokens": 1000}))
    monkeypatch.chdir(tmp_path)  # data paths in a run config are relative to where the run started
    # the run's checkpoint folder: its newest complete step is picked
    lm = GDN2LM(checkpoint=str(step.parent), device="cpu", dtype="float64")
    assert lm.tokenizer.path.resolve() == (data / "tokenizer.model").resolve()
    assert lm.config == cfg
    for name, tensor in state.items():
        assert torch.equal(lm.model.state_dict()[name], tensor.double()), name
