"""The network: the control plane and its signed records (``control``), the DHT wrapper (``dht``), data-plane
handlers (artifacts, probes, dial-back; the run snapshot light clients read, ``snapshot``) and the blob transport,
WAN emulation and the Prometheus endpoint.

May import ``model``, ``data``, ``common`` and ``hlbp.protocol``; nothing of train, rounds, node, sim or bench.
"""
