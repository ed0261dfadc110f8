"""Training on one machine: the inner AdamW trainer, checkpoints, ``hlbp train`` (``local``) and the JSONL
metrics log.

May import ``model``, ``data`` and ``common``; nothing of rounds, net, node, sim or bench.
"""
