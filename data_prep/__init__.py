"""Corpus preparation: tokenizer training (``train_tokenizer``), corpus -> packed shards (``prepare``),
and the built-in corpus that needs no download (``default_corpus``)."""
