"""The daemon-free light client: watch a run and fetch its artifacts over py-libp2p, without p2pd or hivemind.

It dials one hlbp node, asks for its snapshot of the run's signed records (served by :mod:`hlbp.peer.net.snapshot`)
and verifies every record itself with :mod:`hlbp.protocol.snapshot`; artifacts come by content hash from the same
data-plane handler joiners use. py-libp2p and hivemind register the same protobuf and multiaddr names, so they
cannot share a process: this package imports nothing of hivemind, directly or through ``net``, and a test checks
the ``sys.modules`` of a light process.

May import ``common`` and ``hlbp.protocol`` only.
"""
