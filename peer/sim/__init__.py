"""Simulations on one machine: the loopback swarm of real processes behind ``hlbp simulate`` (``launcher``) and
the in-process outer-round engine the research benchmarks use (``engine``).

Top of the stack beside ``node`` and ``bench``: may import every other sub-package of hlbp.peer.
"""
