"""The payload fetch trees: bounded uploads whatever N, every chain ends at the sender, outsiders spread out."""

from __future__ import annotations

from collections import Counter

from hlbp.peer.rounds.spread import FANOUT, chain, depth, sources, tree

PEERS = [f"peer{i:04d}" for i in range(1000)]


def _level(i: int) -> int:
    level, start, width = 0, 0, 1
    while start + width <= i:
        start, width, level = start + width, width * FANOUT, level + 1
    return level


def test_each_peer_fetches_from_its_parent_then_up_the_levels_to_the_sender() -> None:
    order = tree(7, "peer0003", PEERS[:50], members=["peer0003", "peer0009", "peer0020", "peer0030"])
    assert order[0] == "peer0003" and set(order[1:4]) == {"peer0009", "peer0020", "peer0030"}
    assert sorted(order) == sorted(PEERS[:50])
    for i, me in enumerate(order[1:], start=1):
        chain = sources(7, "peer0003", me, PEERS[:50], members=["peer0003", "peer0009", "peer0020", "peer0030"])
        assert chain[0] == order[(i - 1) // FANOUT] and chain[-1] == "peer0003" and me not in chain
        ancestors, node = [], (i - 1) // FANOUT
        while node:
            ancestors.append(order[node])
            node = (node - 1) // FANOUT
        assert set(ancestors) <= set(chain)  # every ancestor is asked ...
        levels = [_level(order.index(p)) for p in chain]
        assert levels == sorted(levels, reverse=True) and levels[0] < _level(i)  # ... and nobody deeper than us
    assert sources(7, "peer0003", "peer0003", PEERS[:50]) == []


def test_the_children_of_a_peer_that_left_spread_over_its_level() -> None:
    order = tree(2, "peer0000", PEERS[:400])
    dead = order[7]  # a node of level 2: its children ask another node of level 2 next
    children = [order[i] for i in range(1, len(order)) if (i - 1) // FANOUT == 7]
    grandchildren = [order[i] for i in range(1, len(order)) if (i - 1) // FANOUT in {order.index(c) for c in children}]
    seconds = {chain(order, c, 2)[1] for c in children + grandchildren if chain(order, c, 2)[0] == dead}
    assert len(seconds) >= 3 and dead not in seconds


def test_trees_differ_per_sender_and_round() -> None:
    assert tree(1, "peer0001", PEERS[:100]) != tree(1, "peer0005", PEERS[:100])
    assert tree(1, "peer0001", PEERS[:100]) != tree(2, "peer0001", PEERS[:100])
    assert tree(1, "peer0001", PEERS[:100], shard=0) != tree(1, "peer0001", PEERS[:100], shard=1)


def test_uploads_stay_about_f_per_peer_and_bounded_whatever_n() -> None:
    members = PEERS[:8]
    for n in (100, 1000):
        up: Counter[str] = Counter()
        for sender in members:  # every peer fetches every member's payload from its parent
            order = tree(3, sender, PEERS[:n], members=members)
            up.update(chain(order, p, 3)[0] for p in PEERS[:n] if p != sender)
        assert sum(up.values()) == 8 * (n - 1)
        assert max(up.values()) <= 8 * FANOUT  # never N: a peer serves at most FANOUT of each payload
        assert sum(up.values()) / n < 8  # about F a peer on average
    assert depth(1000) == 5 and depth(1) == 0 and depth(5) == 1 and depth(6) == 2


def test_peers_outside_the_population_spread_over_the_tree() -> None:
    firsts = Counter(sources(4, "peer0000", f"new{i}", PEERS[:200])[0] for i in range(400))
    assert max(firsts.values()) <= 12 and len(firsts) > 150  # 400 joiners over 200 nodes: spread, none serves all
    for i in range(20):
        assert sources(4, "peer0000", f"new{i}", PEERS[:200])[-1] == "peer0000"
