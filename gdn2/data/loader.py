"""Training and validation batches from packed shards: mixing, shuffling, sharding, exact resume.

How a batch of tokens is found, from the outside in:

1. A *source* is a list of shards (``find_shards``); its token stream is their concatenation.
2. The stream is cut into samples of ``block_size + 1`` tokens. Consecutive samples share one
   boundary token (sample ``i`` is tokens ``[i*B, i*B + B + 1)``), as lit-gpt's next-token setup
   wants: every token after the first is a label exactly once. A source of ``N`` tokens holds
   ``(N - 1) // B`` samples; the tail that does not fill a sample is left out.
3. All ranks and loader workers share one infinite sequence of *global sample indices* ``g``.
   Rank ``r`` of ``W`` builds its ``k``-th micro-batch of ``M`` samples from
   ``g = (k*W + r)*M + m`` for ``m < M``: after ``k`` micro-batches on every rank, exactly the
   indices ``[0, k*W*M)`` have been used, with no overlap and no gap.
4. Mixing: global indices come in blocks of ``MIX_BLOCK``. Each block holds a fixed number of
   samples of each source (weights apportioned by largest remainder), in an order shuffled from
   the seed and the block number. So proportions are exact to ``1 / MIX_BLOCK`` and the source of
   any ``g`` and its index within that source are computed without replaying the past.
5. Shuffling: the ``j``-th sample drawn from a source is sample ``perm_e(j mod n)`` of epoch
   ``e = j // n``, where ``perm_e`` is a permutation of the source's ``n`` samples seeded by
   (seed, source, epoch). Each source rolls over into its next epoch on its own.

Because every batch is a pure function of (seed, sources, shapes, batch number), the loader's
state is a single counter, and resuming, or changing ``num_workers``, replays nothing and skips
nothing.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gdn2.data.shards import PackedShardReader, find_shards, read_header

MIX_BLOCK = 1 << 16
STATE_FORMAT = "gdn2.data.TrainLoader/1"

# Distinct first words of the seed sequences, so the mixing order and the per-epoch
# permutations never share a random stream.
_SHUFFLE_TAG = 0x5348
_MIX_TAG = 0x4D49


class TokenStream:
    """The concatenation of a list of shards, read at arbitrary offsets.

    Shard headers are validated on construction; the memory maps are opened lazily, so the object
    pickles cheaply into loader worker processes.
    """

    def __init__(self, shards: Sequence[str | os.PathLike]):
        self.paths = [Path(p) for p in shards]
        if not self.paths:
            raise ValueError("a token stream needs at least one shard")
        self.counts = [read_header(p)[1] for p in self.paths]
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])
        self._readers: list[PackedShardReader] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_readers"] = None
        return state

    def shard_at(self, offset: int) -> Path:
        """The shard holding stream token ``offset``."""
        return self.paths[int(np.searchsorted(self.starts, offset, side="right")) - 1]

    def read(self, offset: int, length: int) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of the stream as int64, crossing shard ends."""
        if offset < 0 or offset + length > len(self):
            raise IndexError(f"tokens [{offset}, {offset + length}) outside a stream of {len(self)}")
        if self._readers is None:
            self._readers = [PackedShardReader(p) for p in self.paths]
        out = np.empty(length, dtype=np.int64)
        filled = 0
        shard = int(np.searchsorted(self.starts, offset, side="right")) - 1
        while filled < length:
            local = offset + filled - int(self.starts[shard])
            take = min(length - filled, self.counts[shard] - local)
            out[filled : filled + take] = self._readers[shard].tokens[local : local + take]
            filled += take
            shard += 1
        return out


def _samples_in(stream: TokenStream, block_size: int) -> int:
    return max(0, (len(stream) - 1) // block_size)


def _read_samples(stream: TokenStream, sample_ids: np.ndarray, block_size: int) -> np.ndarray:
    """int64 [len(sample_ids), block_size + 1]: sample ``i`` is tokens ``[i*B, i*B + B + 1)``."""
    rows = np.empty((len(sample_ids), block_size + 1), dtype=np.int64)
    for row, sample in enumerate(sample_ids):
        rows[row] = stream.read(int(sample) * block_size, block_size + 1)
    return rows


def document_cu_seqlens(input_ids: np.ndarray, eos_id: int) -> np.ndarray:
    """Segment boundaries of a flattened micro-batch, for document-masked mixers.

    input_ids: int [M, B]. Returns int32 [S + 1], strictly increasing from 0 to M*B: every sample
    start (multiples of B), every position right after an EOS, and the total.
    """
    rows, block = input_ids.shape
    after_eos = np.flatnonzero(input_ids.reshape(-1) == eos_id) + 1
    bounds = np.union1d(np.arange(0, rows * block + 1, block), after_eos)
    return bounds.astype(np.int32)


def _to_batch(rows: np.ndarray, document_masking: bool, eos_id: int) -> dict[str, torch.Tensor]:
    batch = {
        "input_ids": torch.from_numpy(np.ascontiguousarray(rows[:, :-1])),
        "labels": torch.from_numpy(np.ascontiguousarray(rows[:, 1:])),
    }
    if document_masking:
        batch["cu_seqlens"] = torch.from_numpy(document_cu_seqlens(rows[:, :-1], eos_id))
    return batch


def _apportion(weights: Sequence[float], total: int) -> list[int]:
    """Split ``total`` into integers proportional to ``weights`` (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64)
    exact = w / w.sum() * total
    counts = np.floor(exact).astype(np.int64)
    # Ties go to the earlier source, so the result does not depend on sort stability.
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: total - int(counts.sum())]:
        counts[i] += 1
    return [int(c) for c in counts]


class _MixedSampler:
    """Maps a global sample index to (source, sample index inside that source's stream)."""

    def __init__(self, num_samples: Sequence[int], weights: Sequence[float], seed: int):
        self.num_samples = list(num_samples)
        self.seed = seed
        self.per_block = _apportion(weights, MIX_BLOCK)
        self._block_labels = np.repeat(np.arange(len(self.per_block), dtype=np.int16), self.per_block)
        self._block_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._perm_cache: dict[tuple[int, int], np.ndarray] = {}

    def _block(self, block: int) -> tuple[np.ndarray, np.ndarray]:
        """Source of every position in a mixing block, and how many of that source came before."""
        if self._block_cache is None or self._block_cache[0] != block:
            rng = np.random.default_rng([_MIX_TAG, self.seed, block])
            labels = rng.permutation(self._block_labels)
            rank_in_source = np.empty(MIX_BLOCK, dtype=np.int64)
            for source in range(len(self.per_block)):
                where = np.flatnonzero(labels == source)
                rank_in_source[where] = np.arange(len(where))
            self._block_cache = (block, labels, rank_in_source)
        return self._block_cache[1], self._block_cache[2]

    def _permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perm_cache:
            # Two epochs per source at most: the one in use and the one a batch may spill into.
            for old in [k for k in self._perm_cache if k[0] == source and k[1] < epoch - 1]:
                del self._perm_cache[old]
            n = self.num_samples[source]
            index_dtype = np.uint32 if n < 2**32 else np.int64
            rng = np.random.default_rng([_SHUFFLE_TAG, self.seed, source, epoch])
            self._perm_cache[key] = rng.permutation(np.arange(n, dtype=index_dtype))
        return self._perm_cache[key]

    def locate(self, global_index: int) -> tuple[int, int]:
        """(source, sample index in that source) of a global sample index."""
        if len(self.per_block) == 1:
            source, drawn = 0, global_index
        else:
            block, position = divmod(global_index, MIX_BLOCK)
            labels, rank_in_source = self._block(block)
            source = int(labels[position])
            drawn = block * self.per_block[source] + int(rank_in_source[position])
        epoch, index = divmod(drawn, self.num_samples[source])
        return source, int(self._permutation(source, epoch)[index])


class _TrainBatches(IterableDataset):
    """Micro-batches ``start, start+1, ...`` of one rank; in worker ``w`` of ``n`` only those
    with ``(k - start) % n == w``, so a DataLoader's round-robin returns them in order."""

    def __init__(self, streams, weights, seed, block_size, micro_batch_size, rank, world_size,
                 document_masking, eos_id, start, vocab_size=None):
        self.streams = streams
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.rank = rank
        self.world_size = world_size
        self.document_masking = document_masking
        self.eos_id = eos_id
        self.start = start
        self.sampler = _MixedSampler([_samples_in(s, block_size) for s in streams], weights, seed)

    def batch(self, k: int) -> dict[str, torch.Tensor]:
        """Micro-batch ``k`` of this rank."""
        first = (k * self.world_size + self.rank) * self.micro_batch_size
        rows = np.empty((self.micro_batch_size, self.block_size + 1), dtype=np.int64)
        for m in range(self.micro_batch_size):
            source, sample = self.sampler.locate(first + m)
            rows[m] = self.streams[source].read(sample * self.block_size, self.block_size + 1)
            if self.vocab_size is not None and (rows[m].max() >= self.vocab_size or rows[m].min() < 0):
                offset = sample * self.block_size
                raise ValueError(f"{self.streams[source].shard_at(offset)}: token id {int(rows[m].max())} near stream "
                                 f"offset {offset} is outside the model's vocabulary of {self.vocab_size}")
        return _to_batch(rows, self.document_masking, self.eos_id)

    def __iter__(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        k = self.start + worker
        while True:
            yield k, self.batch(k)
            k += workers


def _as_int(name: str, value, low: int, high: float = float("inf")) -> int:
    """``value`` as a Python int in ``[low, high)`` (numpy integers welcome), else ValueError naming it."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if not low <= number < high:
        raise ValueError(f"{name} must be in [{low}, {high}), got {number}")
    return number


class TrainLoader:
    """Infinite, shuffled, mixed, rank-sharded training micro-batches with exact resume.

    Args:
        sources: list of ``(path_or_glob_or_dir, weight)``; a directory means its ``train_*.bin``.
            Weights are relative (need not sum to 1) and must be positive.
        block_size: tokens per sample fed to the model (each sample reads ``block_size + 1``).
        micro_batch_size: samples per yielded batch on this rank.
        seed: drives the per-epoch shuffle and the mixing order; identical on every rank.
        rank, world_size: data-parallel position; ranks see disjoint samples.
        num_workers: torch DataLoader worker processes (0 = read in this process). The batches
            are the same, in the same order, whatever this is.
        document_masking: also yield ``cu_seqlens`` (see ``document_cu_seqlens``).
        eos_id: the end-of-document token marking document boundaries.
        vocab_size: when given, a sample holding an id outside ``[0, vocab_size)`` is an error naming
            its shard (checked on every batch, a few microseconds).

    Iterating yields dicts: ``input_ids`` int64 [micro_batch_size, block_size], ``labels`` int64
    [micro_batch_size, block_size] (input shifted left by one), and with document masking
    ``cu_seqlens`` int32 [S + 1] over the flattened micro-batch. The iterator never ends.

    ``state_dict()`` is identical on every rank (a micro-batch counter plus checks), so rank 0's
    copy can be loaded everywhere, also by a loader with another world size or micro-batch size: it
    continues at the same global sample. Call ``load_state_dict`` before iterating.
    """

    def __init__(self, sources: Sequence[tuple[str | os.PathLike, float]], block_size: int,
                 micro_batch_size: int, seed: int = 3407, rank: int = 0, world_size: int = 1,
                 num_workers: int = 0, document_masking: bool = False, eos_id: int = 2,
                 vocab_size: int | None = None):
        block_size, micro_batch_size = _as_int("block_size", block_size, 1), _as_int("micro_batch_size", micro_batch_size, 1)
        world_size = _as_int("world_size", world_size, 1)
        rank, num_workers = _as_int("rank", rank, 0, world_size), _as_int("num_workers", num_workers, 0)
        if isinstance(sources, (str, os.PathLike)) or not sources:
            raise ValueError(f"sources must be a non-empty list of (path, weight) pairs, got {sources!r}")
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.seed = _as_int("seed", seed, 0)
        self.rank = rank
        self.world_size = world_size
        self.num_workers = num_workers
        self.document_masking = document_masking
        self.eos_id = eos_id
        self.vocab_size = vocab_size

        self.streams: list[TokenStream] = []
        self.weights: list[float] = []
        for entry in sources:
            if not (isinstance(entry, (tuple, list)) and len(entry) == 2):
                raise ValueError(f"sources: each entry must be a (path, weight) pair, got {entry!r}")
            spec, weight = entry
            weight = float(weight)
            if not np.isfinite(weight) or weight <= 0:
                raise ValueError(f"sources: weight of {str(spec)!r} must be positive, got {weight}")
            stream = TokenStream(find_shards(spec, split="train"))
            if _samples_in(stream, block_size) < 1:
                raise ValueError(
                    f"sources: {str(spec)!r} holds {len(stream)} tokens, fewer than one sample of "
                    f"block_size + 1 = {block_size + 1}"
                )
            self.streams.append(stream)
            self.weights.append(weight)
        dropped = [str(s[0]) for s, n in zip(sources, _apportion(self.weights, MIX_BLOCK)) if n == 0]
        if dropped:
            raise ValueError(f"sources: weights of {dropped} are below the mixing resolution 1/{MIX_BLOCK}")
        self.num_samples = [_samples_in(s, block_size) for s in self.streams]
        self._fingerprint = self._sources_fingerprint()
        self._consumed = 0

    def _sources_fingerprint(self) -> str:
        # Shard names and sizes, not full paths, so a dataset moved to another directory still resumes.
        desc = [
            {"weight": w, "shards": [[p.name, c] for p, c in zip(s.paths, s.counts)]}
            for s, w in zip(self.streams, self.weights)
        ]
        return hashlib.blake2b(json.dumps(desc).encode(), digest_size=16).hexdigest()

    def _dataset(self) -> _TrainBatches:
        return _TrainBatches(self.streams, self.weights, self.seed, self.block_size, self.micro_batch_size,
                             self.rank, self.world_size, self.document_masking, self.eos_id, self._consumed,
                             self.vocab_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        dataset = self._dataset()
        if self.num_workers == 0:
            batches = iter(dataset)
        else:
            batches = iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers))
        for k, batch in batches:
            if k != self._consumed:
                raise RuntimeError(f"loader workers returned micro-batch {k}, expected {self._consumed}")
            self._consumed += 1
            yield batch

    @property
    def batches_consumed(self) -> int:
        """Micro-batches handed out by this loader so far (on this rank)."""
        return self._consumed

    def state_dict(self) -> dict:
        """Small, picklable resume state; the same on every rank."""
        return {
            "format": STATE_FORMAT,
            "batches_consumed": self._consumed,
            "seed": self.seed,
            "block_size": self.block_size,
            "micro_batch_size": self.micro_batch_size,
            "world_size": self.world_size,
            "sources": self._fingerprint,
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue with the micro-batch after the last one counted in ``state``.

        A state from another world size or micro-batch size continues at the same global sample
        (every sample used once, in the same order) when the samples consumed divide evenly into
        this loader's micro-batches over all ranks. Raises ValueError when the state comes from a
        loader with other sources (shard names, sizes or weights), seed or block size, or when the
        samples consumed do not divide.
        """
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"state: not a TrainLoader state (format {state.get('format') if isinstance(state, dict) else None!r})")
        current = self.state_dict()
        for key in ("sources", "seed", "block_size"):
            if state.get(key) != current[key]:
                what = "sources (shard names, token counts or weights)" if key == "sources" else key
                raise ValueError(
                    f"state: {what} differ: saved {state.get(key)!r}, this loader has {current[key]!r}; "
                    "resuming would not continue the same sample sequence"
                )
        consumed = state.get("batches_consumed")
        if not isinstance(consumed, int) or consumed < 0:
            raise ValueError(f"state: batches_consumed must be a non-negative int, got {consumed!r}")
        samples = consumed * int(state.get("world_size", 1)) * int(state.get("micro_batch_size", 1))
        per_round = self.world_size * self.micro_batch_size
        if samples % per_round:
            raise ValueError(
                f"state: {samples} samples consumed (world size {state.get('world_size')} x micro-batch "
                f"{state.get('micro_batch_size')} x {consumed}) do not divide into rounds of world size "
                f"{self.world_size} x micro-batch {self.micro_batch_size}; resume where they do")
        self._consumed = samples // per_round


class ValLoader:
    """The first batches of a validation stream: finite, unshuffled, re-iterable.

    ``source`` is a path, glob or directory (a directory means its ``val_*.bin``). Samples are
    taken in stream order (same cut as ``TrainLoader``): micro-batch ``t`` of rank ``r`` holds
    samples ``(t*W + r)*M + m``, so ranks are disjoint and all yield the same number of batches,
    ``min(num_batches, samples // (W*M))``. A stream too short for one full round still yields one
    batch of ``samples // W`` rows per rank. Batches have ``TrainLoader``'s dict form.

    ``vocab_size``: when given, every token this rank will ever read is checked at construction (it is a
    bounded prefix of the stream), and an id outside ``[0, vocab_size)`` is a ValueError naming its
    shard, before any step runs (see :meth:`check_vocabulary`).
    """

    def __init__(self, source: str | os.PathLike, block_size: int, micro_batch_size: int, num_batches: int,
                 rank: int = 0, world_size: int = 1, eos_id: int = 2, document_masking: bool = False,
                 vocab_size: int | None = None):
        block_size, micro_batch_size = _as_int("block_size", block_size, 1), _as_int("micro_batch_size", micro_batch_size, 1)
        world_size = _as_int("world_size", world_size, 1)
        rank, num_batches = _as_int("rank", rank, 0, world_size), _as_int("num_batches", num_batches, 1)
        self.source = source
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.eos_id = eos_id
        self.document_masking = document_masking
        self.stream = TokenStream(find_shards(source, split="val"))
        self.num_samples = _samples_in(self.stream, block_size)
        rounds = self.num_samples // (world_size * micro_batch_size)
        if rounds >= 1:
            self.micro_batch_size, self.num_batches = micro_batch_size, min(num_batches, rounds)
        elif self.num_samples >= world_size:
            self.micro_batch_size, self.num_batches = self.num_samples // world_size, 1
        else:
            raise ValueError(
                f"validation source {str(source)!r} holds {len(self.stream)} tokens = {self.num_samples} "
                f"samples of block_size + 1 = {block_size + 1}, fewer than one per rank (world_size {world_size})"
            )
        if vocab_size is not None:
            self.check_vocabulary(vocab_size)

    def __len__(self) -> int:
        return self.num_batches

    def _samples(self, t: int) -> np.ndarray:
        """Sample ids of this rank's batch ``t``."""
        first = t * self.world_size * self.micro_batch_size + self.rank * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size)

    def check_vocabulary(self, vocab_size: int) -> None:
        """ValueError naming the shard when a token this rank reads lies outside ``[0, vocab_size)`` (an
        embedding lookup would fail on it mid-run: an IndexError on a CPU, a device-side assert on CUDA)."""
        for t in range(self.num_batches):
            samples = self._samples(t)
            rows = _read_samples(self.stream, samples, self.block_size)
            bad = np.argwhere((rows >= vocab_size) | (rows < 0))
            if len(bad):
                row, column = (int(i) for i in bad[0])
                offset = int(samples[row]) * self.block_size + column
                raise ValueError(f"{self.stream.shard_at(offset)}: token id {int(rows[row, column])} at stream offset "
                                 f"{offset} is outside the model's vocabulary of {vocab_size}")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for t in range(self.num_batches):
            rows = _read_samples(self.stream, self._samples(t), self.block_size)
            yield _to_batch(rows, self.document_masking, self.eos_id)
