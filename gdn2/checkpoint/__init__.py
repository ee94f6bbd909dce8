"""Checkpoints: everything that writes or reads one.

- ``format``: the folder layout, the ``COMPLETE`` marker with every file's size and sha256, verification,
  bare parameter names
- ``resume``: which checkpoint ``--resume`` continues from; newer ones set aside, old ones pruned
- ``safe_load``: reading checkpoint files without running code (restricted unpickling)
- ``state``: saving and restoring model, optimizer, counters and per-rank states (torch.distributed.checkpoint)
- ``consolidate``: a training checkpoint -> one ``model.pt`` (its folder written whole), and
  ``python -m gdn2 consolidate``
- ``load``: a checkpoint's weights, config and tokenizer for inference; ``load_model``

Each module imports only the ones listed before it.
"""
