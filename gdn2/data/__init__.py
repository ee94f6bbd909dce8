"""Packed token shards on disk -> training and validation micro-batches (the training side of the data).

``shards``: the lit-gpt-compatible packed shard format, its reader and shard discovery (numpy only, so
the data-preparation workers that write shards never import torch). ``loader``: ``TrainLoader`` (mixed,
shuffled, rank-sharded, exactly resumable) and ``ValLoader``. Making shards from a corpus is
``gdn2.data_prep``.
"""
