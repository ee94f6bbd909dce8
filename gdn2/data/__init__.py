"""Packed token shards on disk -> training and validation micro-batches.

``shards``: the lit-gpt-compatible packed shard format, its reader and shard discovery (numpy only).
``loader``: ``TrainLoader`` (mixed, shuffled, rank-sharded, exactly resumable) and ``ValLoader``.
"""

from gdn2.data.shards import PackedShardReader, find_shards, read_manifest, token_dtype_for_vocab, write_shard

_LOADER_NAMES = ("TrainLoader", "ValLoader", "document_cu_seqlens")


def __getattr__(name):
    # The loaders need torch; data preparation workers import only the shard format, and should not
    # pay for importing torch in every process.
    if name in _LOADER_NAMES:
        from gdn2.data import loader

        return getattr(loader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "PackedShardReader",
    "TrainLoader",
    "ValLoader",
    "document_cu_seqlens",
    "find_shards",
    "read_manifest",
    "token_dtype_for_vocab",
    "write_shard",
]
