"""Packed token shards on disk -> training and validation micro-batches.

``shards``: the lit-gpt-compatible packed shard format, its reader and shard discovery.
``loader``: ``TrainLoader`` (mixed, shuffled, rank-sharded, exactly resumable) and ``ValLoader``.
"""

from gdn2.data.loader import TrainLoader, ValLoader, document_cu_seqlens
from gdn2.data.shards import PackedShardReader, find_shards, token_dtype_for_vocab, write_shard

__all__ = [
    "PackedShardReader",
    "TrainLoader",
    "ValLoader",
    "document_cu_seqlens",
    "find_shards",
    "token_dtype_for_vocab",
    "write_shard",
]
