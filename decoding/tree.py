"""Token trees: the verification rules (greedy, lossless sampling, lossy typical
acceptance; docs/decoder.md). Trees sized from measured head accuracies are designed by the
method's own module (`Method.sized_trees`).

A tree of n draft nodes is given by `tokens[i]` and `parents[i]` (the parent's index, or -1
for a child of the last committed token), in topological order (parents first). The target
scores the root (the last committed token) and every node in one forward, so the rules here
take n + 1 rows: row 0 is the root, row i + 1 is node i. Row r holds the target's
distribution over the token that FOLLOWS the node of that row, so node i is judged by the row
of its parent, `parents[i] + 1`.

Pure functions over tensors and lists: nothing here knows about models or caches.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.sampling import draw


def children_of(parents: list[int]) -> list[list[int]]:
    """children[r] = the nodes whose parent is row r (r = 0: the root), in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree nodes must come after their parents; node {i} has parent {parent}")
        children[parent + 1].append(i)
    return children


def depths(parents: list[int]) -> list[int]:
    """1-based depth of each node: a child of the root has depth 1."""
    depth: list[int] = []
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"tree nodes must come after their parents; node {i} has parent {parent}")
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return depth


def truncate_tree(parents: list[int], max_depth: int) -> list[int]:
    """The nodes (indices, in order) of depth <= max_depth; their parents stay among them."""
    return [i for i, d in enumerate(depths(parents)) if d <= max_depth]


def verify_tree_greedy(target_argmax: list[int], parents: list[int], tokens: list[int]) -> tuple[list[int], int]:
    """Greedy verification: from the root, move to the child whose token is the target's argmax
    at the current node, as long as there is one; then emit the argmax at the last node.

    target_argmax: [n + 1] host ints (row 0 = root). Returns (path, next_token): the accepted
    node indices from the root down, and the token emitted after them.
    """
    children = children_of(parents)
    path: list[int] = []
    row = 0
    while True:
        want = target_argmax[row]
        child = next((c for c in children[row] if tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        row = child + 1


def verify_tree(
    p: torch.Tensor, parents: list[int], tokens: list[int] | torch.Tensor, generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Lossless speculative sampling over a tree of deterministic candidates.

    p: [n + 1, V] the target's final sampling distributions (after temperature/top-k/top-p),
    row 0 at the root and row i + 1 at node i. Returns (path, next_token).

    The rule (recursive rejection sampling, as the reference tree decoders' `evaluate_posterior`),
    at the current node with distribution p and children x_1, x_2, ... tried in order:
        accept x_j        with probability  r(x_j),   r = p with x_1..x_{j-1} set to 0, renormalised
        on acceptance     move to x_j and start over with x_j's own p
        all rejected      sample the next token from r (p restricted to the untried tokens)
    Why the emitted token is distributed exactly as p: by induction over j, the probability of
    reaching sibling j is 1 - p(x_1) - ... - p(x_{j-1}) = m_j (the residual mass), so x_j is
    emitted with probability m_j * p(x_j) / m_j = p(x_j); a repeated token has r = 0 and is
    never emitted twice; on rejecting all, the residual is p conditioned on "none of the tried
    tokens", reached with probability 1 - sum p(tried), so every untried y comes out with
    probability p(y). Each accepted node is a fresh context, so the argument repeats below it.
    """
    n = len(parents)
    children = children_of(parents)
    if p.shape[0] != n + 1:
        raise ValueError(f"p must have one row per node plus the root ({n + 1}), got {list(p.shape)}")
    token_l = [int(t) for t in tokens] if isinstance(tokens, list) else tokens.tolist()
    token_t = torch.tensor(token_l, dtype=torch.long, device=p.device)
    parent_rows = torch.tensor([q + 1 for q in parents], dtype=torch.long, device=p.device)
    # One device->host copy: p(x_i) at each node's parent, and one uniform per node (each node
    # is tried at most once, so the uniforms are independent draws).
    p_x = p[parent_rows, token_t].double() if n else p.new_zeros(0, dtype=torch.float64)
    u = torch.rand(n, generator=generator, device=p.device, dtype=torch.float64)
    both = torch.stack([p_x, u]).tolist() if n else [[], []]
    p_x, u = both

    path: list[int] = []
    row = 0
    while True:
        tried: list[int] = []  # tokens rejected at this node
        mass = 1.0  # residual mass m = 1 - sum_{tried} p(x)
        accepted = None
        for c in children[row]:
            x = token_l[c]
            if x in tried:
                continue  # r(x) = 0 after its first rejection
            # accept with r(x) = p(x) / m  <=>  u * m < p(x)
            if u[c] * mass < p_x[c]:
                accepted = c
                break
            tried.append(x)
            mass -= p_x[c]
        if accepted is None:
            return path, _sample_residual(p[row], tried, generator)
        path.append(accepted)
        row = accepted + 1


def _sample_residual(p_row: torch.Tensor, tried: list[int], generator) -> int:
    """A draw from p_row with the tried tokens removed (renormalised)."""
    if not tried:
        return int(draw(p_row, generator))
    residual = p_row.clone()
    residual[torch.tensor(tried, device=p_row.device)] = 0.0
    # The residual mass is 0 only if the tried tokens hold all of p, where rejecting them all
    # has probability 0; fall back to p so that a float round-off cannot produce NaNs.
    if not bool(residual.sum() > 0):
        residual = p_row
    return int(draw(residual, generator))


def typical_threshold(p_raw: torch.Tensor, epsilon: float, delta: float) -> torch.Tensor:
    """The typical acceptance threshold per row: min(epsilon, delta * exp(-H(p_raw)))."""
    entropy = -torch.where(p_raw > 0, p_raw * torch.log(p_raw), torch.zeros_like(p_raw)).sum(-1)
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def verify_tree_typical(
    logits: torch.Tensor,
    p: torch.Tensor,
    parents: list[int],
    tokens: list[int] | torch.Tensor,
    temperature: float,
    epsilon: float,
    delta: float,
    generator: torch.Generator | None = None,
) -> tuple[list[int], int, float]:
    """Typical acceptance (Cai et al., 2024; LOSSY: the output is NOT distributed as the target's).

    At the current node, with p_raw = softmax(logits / T) (no top-k/top-p) and H its entropy,
    child x passes if p_raw(x) > min(epsilon, delta * exp(-H)); move to the first child (in
    order) that passes; when none does, sample the next token from p (the final sampling
    distribution) and stop. Needs T > 0 (at T = 0 p_raw is one-hot: the rule is greedy).

    Returns (path, next_token, kl): kl = sum over accepted nodes of -log p(x) = KL(delta_x || p),
    the cost of emitting x where the target would have sampled from p (0 for the sampled
    token). An estimate of how far the emitted law is from the target's (it bounds the KL
    of the mixture that was actually emitted, by convexity); inf if x is outside p's support
    (top-k/top-p removed it).
    """
    if temperature <= 0:
        raise ValueError("typical acceptance needs temperature > 0; at T = 0 use verify_tree_greedy")
    n = len(parents)
    children = children_of(parents)
    if p.shape[0] != n + 1 or logits.shape[0] != n + 1:
        raise ValueError(f"logits and p need one row per node plus the root ({n + 1})")
    token_t = torch.as_tensor(tokens, device=p.device).long()
    p_raw = torch.softmax(logits.float() / temperature, dim=-1)
    threshold = typical_threshold(p_raw, epsilon, delta)  # [n + 1]
    parent_rows = torch.tensor([q + 1 for q in parents], dtype=torch.long, device=p.device)
    if n:
        passes = p_raw[parent_rows, token_t] > threshold[parent_rows]
        cost = -torch.log(p[parent_rows, token_t].double())
        passes, cost = torch.stack([passes.double(), cost]).tolist()
    else:
        passes, cost = [], []
    path: list[int] = []
    kl = 0.0
    row = 0
    while True:
        child = next((c for c in children[row] if passes[c]), None)
        if child is None:
            return path, int(draw(p[row], generator)), kl
        path.append(child)
        kl += cost[child]
        row = child + 1
