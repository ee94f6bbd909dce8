"""Data preparation: a corpus becomes a SentencePiece tokenizer and packed token shards.

``train_tokenizer``: ``python -m gdn2 tokenizer`` (a SentencePiece BPE tokenizer from a sample of
documents). ``prepare``: ``python -m gdn2 prepare`` (documents -> ``train_*.bin`` / ``val_*.bin`` and
``manifest.json``, on all cores, resumable). ``default_corpus``: ``python -m gdn2 corpus`` (the
built-in corpus from Python's own standard library sources, no download).

Installed as ``gdn2.data_prep``; in a checkout each module also runs as a script
(``python data_prep/prepare.py ...``). Nothing here imports torch: the workers stay light.
"""
