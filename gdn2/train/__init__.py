"""The training loop's pieces; ``python -m gdn2 pretrain`` (``cli``) is the command line over
:func:`gdn2.train.loop.fit`.

- ``recipe``: config sections beside ``model:``, ``--section.key`` overrides, the derived plan
- ``setup``: Fabric (single device, DDP, FSDP, FSDP2), the model and optimizer, the run folder and its lock
- ``loop``: ``train_step`` and ``fit``, which composes the components below
- ``checkpointer``: when to save and what a save holds (the format is :mod:`gdn2.checkpoint`)
- ``validate``: validation loss at several lengths, lm-eval during training
- ``metrics``: MFU, the loggers (JSONL, TensorBoard, CSV, W&B), the progress bar
- ``loss``: a micro-batch's loss (the cross-entropy itself is :mod:`gdn2.loss`)
- ``optimizer``: AdamW parameter groups (no decay on A_log, dt_bias, norms, biases)
- ``schedule``: ``cosine_with_warmup``, and when a periodic task is due
- ``slurm``: topology from SLURM / torchrun, stop signals, requeue, wall-clock budgets
- ``peers``: a rank that dies or hangs ends every rank, with one line naming it
- ``profile``: torch.profiler traces of chosen steps
"""
