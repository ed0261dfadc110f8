"""The model: the LLaMA-style decoder and its stage split, the subspace basis and activation codecs between
stages, and the in-process pipeline model.

May import ``common`` and ``hlbp.protocol``; nothing of data, train, rounds, net, node, sim or bench.
"""
