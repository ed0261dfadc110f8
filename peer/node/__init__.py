"""One peer as a whole: measuring its capacity, choosing its role, joining a run and running a full replica.

Top of the stack beside ``sim`` and ``bench``: may import every other sub-package of hlbp.peer.
"""
