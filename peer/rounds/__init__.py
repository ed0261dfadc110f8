"""Outer rounds between replicas: the outer optimizers (``outer``), the contribution wire format
(``contribution``), the replica loop both exchanges share (``loop``), SparseLoCo rounds (``sparseloco``), dense
DiLoCo rounds through hivemind's all-reduce (``diloco``), the pure round decisions (``rules``), state sync, and
following a shard this peer does not hold (``follow``).

May import ``net``, ``train``, ``model``, ``data`` and ``common``; nothing of node, sim or bench.
"""
