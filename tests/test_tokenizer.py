import pytest

from gdn2.tokenizer import Tokenizer


def test_encode_adds_no_special_tokens_by_default(artifacts):
    _, tok, _ = artifacts
    ids = tok.encode("The river starts as a thin stream.")
    assert ids and tok.bos_id not in ids and tok.eos_id not in ids
    assert tok.encode("The river", bos=True)[0] == tok.bos_id == 1
    assert tok.encode("The river", eos=True)[-1] == tok.eos_id == 2
    assert tok.decode(ids) == "The river starts as a thin stream."
    assert tok.vocab_size == 512


def test_folder_resolves_to_tokenizer_model(artifacts):
    folder, tok, _ = artifacts
    assert Tokenizer(folder).path == tok.path


def test_missing_tokenizer_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.model"):
        Tokenizer(tmp_path / "nope.model")


def test_decode_rejects_ids_outside_vocabulary(artifacts):
    _, tok, _ = artifacts
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([5, tok.vocab_size])
