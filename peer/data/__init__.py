"""Training data: the built-in corpus and user corpora (``corpus``), the BPE tokenizer, the validation split and
token streams (``streams``).

May import ``common`` and ``hlbp.protocol``; nothing of model, train, rounds, net, node, sim or bench.
"""
