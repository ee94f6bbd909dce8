from pathlib import Path

import pytest
from train_helpers import write_corpus


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A synthetic packed corpus (train_*.bin, val_*.bin) shared by the trainer tests."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))
