"""The training loop's pieces; ``pretrain/main.py`` is the command line over :func:`gdn2.train.loop.fit`.

- ``recipe``: config sections beside ``model:``, ``--section.key`` overrides, the derived plan
- ``optimizer``: AdamW parameter groups (no decay on A_log, dt_bias, norms, biases)
- ``schedule``: ``cosine_with_warmup``
- ``loss``: fp32 cross-entropy, a slice of tokens at a time
- ``checkpoint``: atomic sharded checkpoints, ``--resume`` resolution, consolidation to one file
- ``metrics``: dense bf16 peaks for MFU, TensorBoard + JSONL
- ``slurm``: topology from SLURM / torchrun, stop signals, requeue, wall-clock budgets
- ``loop``: Fabric set-up and the loop itself (``fit``)
"""
