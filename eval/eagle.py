"""The EAGLE drafter: a one-layer draft that reads the target's features (EAGLE-1/3), as a
chain or as an EAGLE-2 dynamic tree.

What the draft computes (`head` = `draftsmith.heads.eagle.EagleHead`). For a committed
position t, the "pair" t is (token_{t+1}, f_t), fed at position t:
    f_t           the target's feature at t: eagle1 the last hidden state (post-norm),
                  eagle3 project(concat of the aux hidden states at t)
    head(pair t)  -> (g_t, logits over token_{t+2})
Pairs exist for every t <= len(context) - 2; the last one (context[-1], f_{len-2}) predicts the
first draft. Drafting further feeds the draft's own g as the next feature, with the drafted
token, one position further on. Tokens go into the head as TARGET ids (its embedding is the
target's) while its logits cover the draft vocabulary: drafted ids pass through
`head.draft_to_target` before they are fed or proposed. Those speculative entries go into the draft's KV cache and are
cropped away afterwards: the cache only ever keeps REAL pairs, because EAGLE re-feeds accepted
tokens with the target's true features (which arrive through `observe`) rather than keeping
the draft's own guesses for them.

Chain (`tree=None`): the draft's argmax at every step, deterministic (probs=None), so the
chain verifier's q is one-hot on each token and the decode is lossless at any temperature.

EAGLE-2 dynamic tree (`tree={"depth": d, "top_k": k, "total_tokens": n}`):
    1. the root's top-k tokens are the first frontier (depth 1);
    2. d times: feed the whole frontier in ONE draft forward (tree mask: each node sees the
       real cache and its own ancestors; position = the last pair's + depth), give every
       frontier node its top-k children, score every child by its cumulative log-probability
       log q(x_1) + ... + log q(x_j), and keep the best k children as the next frontier;
    3. rerank ALL generated nodes (d * k^2 + k) by cumulative log-probability and keep the
       best n. log q <= 0, so a child never scores above its parent: ties go to the shallower
       node, and a kept node's ancestors are therefore always kept.
Nodes come back in generation order (depth by depth, so parents first), deterministic.
Unlike SafeAILab's `total_token`, `total_tokens` here counts draft nodes only (the root, i.e.
the last committed token, is not one of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from draftsmith.eval.drafters import Drafter, Proposal

#: EAGLE-2's keys, all required (SafeAILab's defaults: depth 5-7, top_k 10, total ~60).
TREE_KEYS = ("depth", "top_k", "total_tokens")


def _check_tree(tree: dict) -> dict:
    if not isinstance(tree, dict):
        raise TypeError(f"tree must be a dict with keys {TREE_KEYS} (or None for a chain), got {type(tree).__name__}")
    unknown = sorted(set(tree) - set(TREE_KEYS))
    missing = [key for key in TREE_KEYS if key not in tree]
    if unknown or missing:
        raise ValueError(
            f"EAGLE-2 tree settings need exactly the keys {TREE_KEYS}; "
            f"unknown: {unknown or 'none'}, missing: {missing or 'none'} "
            '(e.g. {"depth": 5, "top_k": 8, "total_tokens": 48})'
        )
    depth, top_k, total = (int(tree[key]) for key in TREE_KEYS)
    if depth < 0 or top_k < 1 or total < 1:
        raise ValueError(f"tree needs depth >= 0, top_k >= 1 and total_tokens >= 1, got {tree}")
    return {"depth": depth, "top_k": top_k, "total_tokens": total}


def _default_cache():
    from draftsmith.heads.eagle import EagleCache  # imported late: the head is optional

    return EagleCache()


class EagleDrafter(Drafter):
    """EAGLE-1/EAGLE-3 drafting over the target's hidden states `head.config.aux_layer_ids`.

    `head`: an `EagleHead` (see the module docstring for what is called on it).
    `tree`: None for a chain of argmax tokens, or the EAGLE-2 dict `{"depth", "top_k",
    "total_tokens"}`. `typical=(epsilon, delta)`: Medusa's LOSSY typical acceptance (as for
    `MedusaDrafter`); None = lossless.
    `cache_factory`: returns an empty draft KV cache (default `heads.eagle.EagleCache`); tests
    hand in a stand-in head with its own cache.
    After a tree proposal, `last_scores` holds each node's cumulative log q (for analysis).
    """

    deterministic = True

    def __init__(
        self,
        head: torch.nn.Module,
        *,
        tree: dict | None = None,
        name: str = "eagle",
        typical: tuple[float, float] | None = None,
        cache_factory: Callable[[], object] | None = None,
    ):
        self.head = head
        self.target_layers = tuple(int(i) for i in head.config.aux_layer_ids)
        if not self.target_layers:
            raise ValueError("head.config.aux_layer_ids is empty: the EAGLE head must name the target layers it reads")
        self.tree = None if tree is None else _check_tree(tree)
        self.name = name
        self.typical = tuple(typical) if typical is not None else None
        self._new_cache = cache_factory or _default_cache
        self.cache = self._new_cache()
        self.last_scores: torch.Tensor | None = None  # tree: cumulative log q of the last proposal's nodes
        self._reset_state()

    @property
    def max_depth(self) -> int | None:
        """K for this drafter: a tree reaches depth `depth + 1` (the root's top-k, then `depth`
        expansions); a chain has no limit of its own (None: as long as the decoder asks)."""
        return None if self.tree is None else self.tree["depth"] + 1

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens if self.tree is None else self.tree["total_tokens"],)

    # --------------------------------------------------------------------------- state

    def _reset_state(self) -> None:
        self.cache.reset()
        self._real = 0  # pairs (real, committed) held by the draft cache
        self._pending: list[torch.Tensor] = []  # features f_t, t >= _real, not yet in the cache
        self._num_features = 0  # features observed so far (f_0 .. f_{n-1})
        self._root: tuple[torch.Tensor, torch.Tensor] | None = None  # (g, logits) of the last real pair

    def _param(self) -> torch.Tensor:
        return next(self.head.parameters())

    def start(self, prompt_ids: torch.Tensor) -> None:
        self._reset_state()

    @torch.inference_mode()
    def observe(self, hidden: dict[int, torch.Tensor]) -> None:
        param = self._param()
        aux = torch.cat([hidden[i].to(device=param.device, dtype=param.dtype) for i in self.target_layers], dim=-1)
        if aux.shape[0]:
            self._pending.append(self.head.project(aux))
            self._num_features += aux.shape[0]

    def _drop_speculation(self) -> None:
        if self.cache.seq_len > self._real:
            self.cache.crop(self._real)

    def accepted(self, num_accepted: int) -> None:
        self._drop_speculation()

    def accepted_path(self, path: list[int]) -> None:
        self._drop_speculation()

    # ------------------------------------------------------------------------- drafting

    def _catch_up(self, context: torch.Tensor) -> None:
        """Feed every committed pair the cache lacks in one forward; keep the last output."""
        self._drop_speculation()
        available = min(self._num_features, context.shape[0] - 1)  # pairs t = 0 .. available-1
        if available <= self._real:
            return
        param = self._param()
        features = torch.cat(self._pending)
        count = available - self._real
        ids = context[self._real + 1 : available + 1].to(param.device)
        positions = torch.arange(self._real, available, device=param.device)
        g, logits = self.head(ids[None], features[None, :count], position_ids=positions[None], cache=self.cache)
        self._root = (g[0, -1], logits[0, -1])
        self._pending = [features[count:]] if count < features.shape[0] else []
        self._real = available

    @torch.inference_mode()
    def propose(self, context, num_tokens, sampling, generator=None) -> Proposal:
        self._catch_up(context)
        if self._root is None or num_tokens < 1:  # a one-token prompt: nothing observed yet
            return Proposal(tokens=context.new_empty(0))
        if self.tree is None:
            return self._chain(context, num_tokens)
        return self._dynamic_tree(context, num_tokens)

    def _chain(self, context, num_tokens) -> Proposal:
        g, logits = self._root
        drafted, raw = [], []
        for i in range(num_tokens):
            token = self.head.draft_to_target(logits.argmax(-1, keepdim=True))  # the head reads target ids
            drafted.append(token)
            raw.append(logits)
            if i + 1 < num_tokens:  # the next position: the drafted token with the draft's own g
                position = torch.full((1, 1), self._real + i, device=token.device)
                out, step = self.head(token[None], g[None, None], position_ids=position, cache=self.cache)
                g, logits = out[0, -1], step[0, -1]
        target_logits = self.head.target_logits(torch.stack(raw)).float()
        return Proposal(tokens=torch.cat(drafted).to(context.device), logits=target_logits)

    def _dynamic_tree(self, context, num_tokens) -> Proposal:
        depth = min(self.tree["depth"], num_tokens - 1)  # nodes then reach depth <= num_tokens
        top_k, total = self.tree["top_k"], self.tree["total_tokens"]
        g_root, logits = self._root
        device = g_root.device
        real = self._real

        # Every generated node: target token, cumulative log q, parent (-1 = the root).
        logq = torch.log_softmax(logits.float(), -1).clamp(max=0.0)
        score, token = logq.topk(min(top_k, logq.shape[-1]))
        token = self.head.draft_to_target(token)
        scores, tokens, parents = [score], [token], [torch.full_like(token, -1)]
        frontier = torch.arange(token.shape[0], device=device)  # node ids of the current frontier
        hidden = g_root.expand(token.shape[0], -1)  # what each frontier node reads: its parent's g
        seen = torch.zeros(token.shape[0], 0, dtype=torch.bool, device=device)  # ancestors among fed rows
        count = token.shape[0]
        blocked = torch.finfo(self._param().dtype).min
        for step in range(depth):
            width = frontier.shape[0]
            # The frontier sees the real cache, its ancestors (earlier fed rows) and itself.
            seen = torch.cat([seen, torch.eye(width, dtype=torch.bool, device=device)], dim=1)
            mask = torch.zeros(1, 1, width, real + seen.shape[1], dtype=self._param().dtype, device=device)
            mask[0, 0, :, real:] = torch.where(seen, 0.0, blocked)
            positions = torch.full((1, width), real + step, device=device)
            ids = torch.cat(tokens)[frontier]
            out, step_logits = self.head(
                ids[None], hidden[None], position_ids=positions, attention_mask=mask, cache=self.cache
            )
            logq = torch.log_softmax(step_logits[0].float(), -1).clamp(max=0.0)
            child_logq, child_token = logq.topk(min(top_k, logq.shape[-1]), dim=-1)  # [width, k]
            child_token = self.head.draft_to_target(child_token)
            child_score = torch.cat(scores)[frontier, None] + child_logq
            scores.append(child_score.flatten())
            tokens.append(child_token.flatten())
            parents.append(frontier.repeat_interleave(child_token.shape[1]))
            # The next frontier: the best k children (ties: the earlier generated one).
            best = _top_in_order(child_score.flatten(), top_k)
            row = best // child_token.shape[1]  # which fed row each new frontier node hangs off
            frontier = count + best
            hidden, seen = out[0, row], seen[row]
            count += child_score.numel()

        scores, tokens, parents = torch.cat(scores), torch.cat(tokens), torch.cat(parents).tolist()
        # Rerank everything generated; order by (score desc, depth asc, id asc) puts every
        # parent before its children (score never increases along a path), so the kept set is
        # closed under ancestors. Then back to generation order: topological.
        keep = sorted(_top_in_order(scores, total).tolist())
        where = {old: new for new, old in enumerate(keep)}
        kept_parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in keep]
        index = torch.tensor(keep, device=device)
        self.last_scores = scores[index]
        return Proposal(tokens=tokens[index].to(context.device), parents=kept_parents)


def _top_in_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores; among equal scores the smaller index wins (a stable
    sort: generated ids grow with depth, so a parent beats a child of equal score)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[: min(k, scores.numel())]
