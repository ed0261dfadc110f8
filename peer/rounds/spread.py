"""Whom a peer fetches an accepted payload from: a tree per payload, so that each peer uploads about F payloads a
round (the gather set's size) whatever the run's size.

Every in-sync peer applies every accepted payload, so a round moves N x F payloads. Fetched from the members (the
holders of what they verified), the F members between them uploaded all of them: about N payloads each (52 MB for
one member in one round at N = 1000 with the tiny model's 48 KB payloads, simulated). Here each payload of round r
has its own tree (:func:`tree`): the sender at the root, the round's other members of its shard next, then the
peers announced online that apply the shard, each part in rendezvous order of (round, sender, shard, peer); the peer at position i >= 1 fetches from
position (i - 1) // ``fanout`` (:func:`sources`). A peer serves at most ``fanout`` fetches of a payload (more only
as a fallback) and sits in F trees, so its uploads stay about F payloads a round on average and at most
``fanout`` x F. A fetch from a peer that is still fetching the payload waits for it
(:meth:`hlbp.peer.net.transport.P2PBlobTransport.sharing`).

Peers differ a little in whom they count (announcements read at different times, a joiner): that only unbalances
the trees, and every peer falls back up its chain to the sender, so a payload is lost only with its sender. A peer
outside the population fetches from a node picked by hashing, then up that node's chain. Everything here is pure;
the applier and the protocol simulator run it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

FANOUT = 4  # fetches a peer serves of one payload: the trees' depth is log4(N), 5 at N = 1000
TRIES = 6  # of its chain a peer asks (three levels; each failure can cost a timeout) before the coordinator and sender


def _rank(r: int, sender: str, shard: int, peer: str) -> bytes:
    return hashlib.sha256(f"spread|{r}|{sender}|{shard}|{peer}".encode()).digest()


def tree(r: int, sender: str, population: Iterable[str], shard: int = 0, members: Iterable[str] = ()) -> list[str]:
    """Round r's fetch tree of ``sender``'s payload for ``shard``, as a list (position i's parent is
    (i - 1) // fanout): the sender, the round's other ``members``, then ``population``, each part in rendezvous
    order of (r, sender, shard, peer). The members head the tree because they are surely there (they have just
    contributed), where the population may name peers that left since it was read; the rendezvous order gives each
    member a different place in each tree, so no member sits near the top of all of them."""
    mid = sorted(set(members) - {sender}, key=lambda p: _rank(r, sender, shard, p))
    rest = sorted(set(population) - {sender} - set(mid), key=lambda p: _rank(r, sender, shard, p))
    return [sender, *mid, *rest]


def sources(r: int, sender: str, me: str, population: Iterable[str], fanout: int = FANOUT, shard: int = 0,
            members: Iterable[str] = ()) -> list[str]:
    """Whom ``me`` asks for ``sender``'s payload of round r (``shard``), first to last (:func:`chain`). Empty for
    the sender itself."""
    if me == sender:
        return []
    return chain(tree(r, sender, population, shard, members), me, r, shard, fanout)


def chain(order: Sequence[str], me: str, r: int, shard: int = 0, fanout: int = FANOUT) -> list[str]:
    """:func:`sources` over a tree already built (``order``, from :func:`tree`): for each level from our parent's
    up to the root, the ancestor at that level, then another node of that level picked by hashing. The second
    choice is for a dead ancestor (the announcements, read now and then, name peers that left since): its children then spread over its level
    instead of all falling on the grandparent, which would pile a whole subtree onto the nodes near the root."""
    if me == order[0]:
        return []
    if me in order:
        node = (order.index(me) - 1) // fanout
    else:
        node = _pick(f"in|{r}|{me}|{order[0]}|{shard}", len(order))
    out: list[str] = []
    while True:
        out.append(order[node])
        if node == 0:
            return list(dict.fromkeys(out))
        start, end = _level(node, fanout)
        end = min(end, len(order))
        if end - start > 1:
            out.append(order[start + _pick(f"alt|{r}|{me}|{order[0]}|{shard}|{start}", end - start)])
        node = (node - 1) // fanout


def _pick(key: str, n: int) -> int:
    return int.from_bytes(hashlib.sha256(f"spread-{key}".encode()).digest()[:8], "big") % n


def _level(node: int, fanout: int) -> tuple[int, int]:
    """The first position of ``node``'s level and the first of the next one (the root's level is [0, 1))."""
    start, width = 0, 1
    while start + width <= node:
        start, width = start + width, width * fanout
    return start, start + width


def depth(n: int, fanout: int = FANOUT) -> int:
    """How many hops a payload takes to reach the last of ``n`` tree positions."""
    hops, reach, level = 0, 1, 1
    while reach < n:
        level *= fanout
        reach += level
        hops += 1
    return hops
