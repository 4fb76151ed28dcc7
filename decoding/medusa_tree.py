"""Medusa trees from measured head accuracies: the node set with the largest expected accepted
length (`build_medusa_tree`) and that expectation for any tree (`expected_accept_length`).
A tree is the Medusa format: a list of paths of ranks, (0, 2) = head 0's top-1 token, then head
1's third-best below it (`decoding.medusa.MedusaDrafter(tree=...)` decodes it).
"""

from __future__ import annotations


def _path_probability(path: tuple[int, ...], head_accuracies: list[list[float]]) -> float:
    prob = 1.0
    for depth, rank in enumerate(path):
        prob *= head_accuracies[depth][rank]
    return prob


def _check_accuracies(head_accuracies: list[list[float]]) -> None:
    if not head_accuracies or not all(len(row) for row in head_accuracies):
        raise ValueError("head_accuracies must be a non-empty list of non-empty per-rank lists")
    for d, row in enumerate(head_accuracies):
        if any(not 0.0 <= a <= 1.0 for a in row):
            raise ValueError(f"head_accuracies[{d}] must hold probabilities in [0, 1], got {row}")


def build_medusa_tree(head_accuracies: list[list[float]], num_nodes: int) -> list[tuple[int, ...]]:
    """The tree of `num_nodes` nodes with the largest expected accepted length.

    head_accuracies[d][r]: measured probability that head d's rank-r token is the right one.
    Under independence across heads, the node (r_0, ..., r_d) is accepted with probability
    prod_j acc[j][r_j] (the ranks at one depth are exclusive events: one token is right), so the
    expected number of accepted drafts is the sum of these path probabilities over the nodes.
    Adding nodes greedily by path probability maximises that sum: a child never beats its
    parent (acc <= 1), so the greedy set is always a valid tree and holds the num_nodes largest
    path probabilities. Ties go to the shallower, then lexicographically smaller path.

    Returns every node's own path, in the order added (the Medusa tree format: a list of paths).
    """
    _check_accuracies(head_accuracies)
    if num_nodes < 1:
        raise ValueError(f"num_nodes must be >= 1, got {num_nodes}")
    max_nodes = 0
    width = 1
    for row in head_accuracies:
        width *= len(row)
        max_nodes += width
    num_nodes = min(num_nodes, max_nodes)

    def key(path):
        return (-_path_probability(path, head_accuracies), len(path), path)

    frontier = {(r,) for r in range(len(head_accuracies[0]))}
    tree: list[tuple[int, ...]] = []
    while len(tree) < num_nodes:
        best = min(frontier, key=key)
        frontier.remove(best)
        tree.append(best)
        if len(best) < len(head_accuracies):
            frontier.update(best + (r,) for r in range(len(head_accuracies[len(best)])))
    return tree


def expected_accept_length(paths: list[tuple[int, ...]], head_accuracies: list[list[float]]) -> float:
    """E[accepted drafts per call] of a Medusa tree under independent head accuracies: the sum
    over the tree's nodes (every prefix of every path, once) of the path probability.
    Does NOT count the bonus token: the predicted tau is 1 + this."""
    _check_accuracies(head_accuracies)
    nodes = set()
    for path in paths:
        path = tuple(path)
        if len(path) > len(head_accuracies):
            raise ValueError(f"path {path} is deeper than the {len(head_accuracies)} measured heads")
        for d in range(1, len(path) + 1):
            nodes.add(path[:d])
    return sum(_path_probability(node, head_accuracies) for node in nodes)
