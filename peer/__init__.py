"""hlbp.peer: the runtime of one node, one sub-package per concern.

Imports point downward only (``tests/test_layout.py`` enforces it):

- ``node``, ``sim``, ``bench``: entry points (joining a run, the replica process, loopback swarms, benchmarks);
- ``rounds``: the outer rounds between replicas (optimizers, contribution wire format, sparse and dense exchange,
  pure rules, state sync);
- ``net``: the control plane, the DHT, the data plane and its transports, WAN emulation, Prometheus export;
- ``train``: the inner trainer, checkpoints, local training and the metrics log;
- ``model``: the decoder, its stage split and the activation codecs between stages;
- ``data``: corpus, tokenizer and token streams;
- ``common``: the error type shown to users and atomic file writes, which every layer may use.
"""
