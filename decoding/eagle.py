"""The EAGLE drafter for B rows: a one-layer draft that reads the target's features (EAGLE-1/3),
as a chain or as an EAGLE-2 dynamic tree.

What the draft computes (`head` = `draftsmith.heads.eagle.EagleHead`). For a committed
position t, the "pair" t is (token_{t+1}, f_t), fed at position t:
    f_t           the target's feature at t: eagle1 the last hidden state (post-norm),
                  eagle3 project(concat of the aux hidden states at t)
    head(pair t)  -> (g_t, logits over token_{t+2})
The head's ragged KV store (`decoding/kv.py`; on the static path sized up front, its steps
compiled by `--compile` like the target's) holds each
row's REAL pairs only: the pairs of the tokens a verification committed are fed at the next `propose` (their
features arrive with the verification), then the proposal drafts with the head's own g as the
feature, one position further on per depth, and those speculative columns are cut again. Tokens
go into the head as TARGET ids while its logits cover the draft vocabulary (`draft_to_target`).

Chain (`tree=None`): the draft's argmax at every step; deterministic (q one-hot on each token),
so lossless at any temperature.

EAGLE-2 dynamic tree (`tree={"depth": d, "top_k": k, "total_tokens": n}`), per row:
    1. the root's top-k tokens are the first frontier (depth 1);
    2. d times: feed every row's frontier in ONE draft forward (each node sees its row's real
       pairs and its own ancestors; position = the row's last pair + depth), give every frontier
       node its top-k children, score each child by its cumulative log-probability, and keep
       the best k children as the next frontier;
    3. rerank ALL generated nodes (d * k^2 + k) by cumulative log-probability and keep the best
       n. log q <= 0, so a child never scores above its parent: ties go to the earlier
       generated (shallower) node, so a kept node's ancestors are always kept.
Nodes come back in generation order (parents first). `total_tokens` counts draft nodes only.
A frontier's attention over the earlier depths is `attend`'s lookback (kv.py): the cache's last
columns are the proposal's earlier nodes, and each node sees its ancestors among them.
"""

from __future__ import annotations

import torch

from draftsmith.decoding.drafters import HeadDrafter, Proposal
from draftsmith.decoding.masks import chain_attend, spans
from draftsmith.decoding.target import right_align, right_aligned

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


def top_in_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of scores [B, n], the indices of the k largest; among equal scores the smaller
    index wins (a stable sort: generated ids grow with depth, so a parent beats its child)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : min(k, scores.shape[-1])]


class EagleDrafter(HeadDrafter):
    """EAGLE-1/EAGLE-3 drafting over the target's hidden states `head.config.aux_layer_ids`.

    `tree`: None for a chain of argmax tokens, or the EAGLE-2 dict `{"depth", "top_k",
    "total_tokens"}`. `typical=(epsilon, delta)`: LOSSY typical acceptance; None =
    lossless. After a tree proposal `last_scores [B, n]` holds each kept node's cumulative log q.
    """

    def __init__(
        self,
        head: torch.nn.Module,
        *,
        tree: dict | None = None,
        name: str = "eagle",
        typical: tuple[float, float] | None = None,
    ):
        super().__init__(head, name, "EAGLE")
        self.tree = None if tree is None else _check_tree(tree)
        self.max_depth = None if self.tree is None else self.tree["depth"] + 1
        self.trees = self.tree is not None
        self.typical = tuple(typical) if typical is not None else None
        self.last_scores: torch.Tensor | None = None

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        if self.tree is None:
            return (num_tokens,)
        depth, top_k = min(self.tree["depth"], num_tokens - 1), self.tree["top_k"]
        return (min(self.tree["total_tokens"], top_k + depth * top_k * top_k),)

    def _frontier(self, num_tokens: int) -> tuple[int, int]:
        """A tree's (expansion depth, frontier width) for proposals of up to `num_tokens`."""
        return min(self.tree["depth"], num_tokens - 1), min(self.tree["top_k"], self.head.config.draft_vocab_size)

    def prepare(self, batch, capacity, compile, num_tokens, sampling, logits=False) -> float:
        """A sized store holds a request's real pairs (`capacity`) and one proposal's drafts;
        with `compile`, its steps are compiled for every catch-up width (1 to K + 1: the fed last
        token and the accepted drafts, and the chain's one-token steps) and the tree's frontier."""
        looks = dict.fromkeys(range(1, num_tokens + 2), 0)
        drafts = num_tokens - 1
        if self.tree is not None:
            depth, width = self._frontier(num_tokens)
            drafts = depth * width
            if depth:
                looks[width] = (depth - 1) * width  # the deepest frontier sees all the earlier ones
        return self._prepare_store(batch, capacity, compile, logits, looks, drafts)

    def start(self, prompts, prefill, vocab_size) -> None:
        batch, param = len(prompts), self._param()
        self.kv = self._new_store(batch)
        self._real, self._has, self._root = [0] * batch, [False] * batch, None
        self._pending = None  # (ids, features, positions, lo) of the pairs not yet fed
        if prefill:  # pair t = (prompt[t + 1], f_t): the prefill's own layout, one token on
            ids, positions, lo = right_aligned([p[1:] for p in prompts], [0] * batch, param.device)
            self._pending = (ids, self._features(prefill), positions, lo)

    def _feed(self, ids, features, positions, attend, keep=None):
        """Feed W columns (ids [B, W], features [B, W, H]); `attend [B, W, L]` says which of the
        fed columns, and of the cache's last L - W columns (this proposal's earlier drafts), each
        sees."""
        out, logits = self.kv.run(self._step, ids, positions, attend, features, key=self.role)
        self.kv.commit(torch.ones(ids.shape, dtype=torch.bool) if keep is None else keep)
        return out, logits

    def _catch_up(self) -> None:
        """Feed every row's committed pairs the cache lacks; keep each row's last (g, logits)."""
        ids, features, positions, lo = self._pending
        self._pending = None
        width, device = ids.shape[1], ids.device
        keep = spans(width, lo, None, len(lo), "cpu")  # padding columns: holes
        g, logits = self._feed(ids, features, positions, chain_attend(width, lo, None, len(lo), device), keep=keep)
        g, logits = g[:, -1], logits[:, -1]
        got = torch.tensor([width > l for l in lo], device=device)[:, None]
        if self._root is not None:  # a row with no new pair keeps its old root
            g, logits = torch.where(got, g, self._root[0]), torch.where(got, logits, self._root[1])
        self._root = (g, logits)
        self._real = [r + width - l for r, l in zip(self._real, lo)]
        self._has = [h or width > l for h, l in zip(self._has, lo)]

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        most = max(num_tokens)
        drafts = most - 1 if self.tree is None else self._frontier(most)[0] * self._frontier(most)[1]
        # Room for the catch-up and every draft: no compaction moves the columns in between.
        self.kv.reserve(drafts + (0 if self._pending is None else self._pending[0].shape[1]))
        if self._pending is not None:
            self._catch_up()
        counts = [k if has else 0 for k, has in zip(num_tokens, self._has)]
        if max(counts) == 0:
            return Proposal.empty(len(counts), self._param().device)
        start = self.kv.length
        base = torch.tensor(self._real, device=self._param().device)[:, None]
        if self.tree is None:
            proposal = self._chain(base, counts)
        else:
            proposal = self._expand(base, min(self.tree["depth"], max(counts) - 1), counts)
        self.kv.retain(start, [0] * len(counts))  # only real pairs stay
        self.kv.compact_if_wasteful()
        return proposal

    def _chain(self, base, counts) -> Proposal:
        g, logits = self._root
        drafted, raw = [], []
        for i in range(max(counts)):
            token = self.head.draft_to_target(logits.argmax(-1))  # the head reads target ids
            drafted.append(token)
            if self.logits:
                raw.append(logits)
            if i + 1 < max(counts):  # the next position: the drafted token with the head's own g
                seen = torch.ones(len(counts), 1, i + 1, dtype=torch.bool, device=token.device)
                out, step_logits = self._feed(token[:, None], g[:, None], base + i, seen)
                g, logits = out[:, -1], step_logits[:, -1]
        raw = self.head.target_logits(torch.stack(raw, dim=1)).float() if raw else None
        return Proposal(tokens=torch.stack(drafted, dim=1), counts=counts, logits=raw)

    def _expand(self, base, depth: int, counts) -> Proposal:
        """EAGLE-2's expansion for every row (module docstring), then the rerank."""
        g_root, logits = self._root
        batch, top_k, device = g_root.shape[0], self.tree["top_k"], g_root.device
        logq = torch.log_softmax(logits.float(), -1).clamp(max=0.0)
        score, token = logq.topk(min(top_k, logq.shape[-1]))  # [B, k]
        width = token.shape[1]
        scores, tokens, parents = [score], [self.head.draft_to_target(token)], [torch.full_like(token, -1)]
        depths = [torch.ones(width, dtype=torch.long, device=device)]  # of every generated node
        frontier = torch.arange(width, device=device).expand(batch, width)  # node ids of the frontier
        hidden = g_root[:, None].expand(batch, width, -1)  # what each frontier node reads: its parent's g
        seen = torch.zeros(batch, width, 0, dtype=torch.bool, device=device)  # ancestors among fed columns
        count = width
        eye = torch.eye(width, dtype=torch.bool, device=device).expand(batch, width, width)
        for d in range(depth):
            seen = torch.cat([seen, eye], dim=2)  # the frontier sees its ancestors and itself
            ids = torch.cat(tokens, dim=1).gather(1, frontier)
            out, step_logits = self._feed(ids, hidden, (base + d).expand(batch, width), seen)
            logq = torch.log_softmax(step_logits.float(), -1).clamp(max=0.0)
            child_logq, child_token = logq.topk(min(top_k, logq.shape[-1]), dim=-1)  # [B, w, k]
            child_score = torch.cat(scores, dim=1).gather(1, frontier)[..., None] + child_logq
            scores.append(child_score.flatten(1))
            tokens.append(self.head.draft_to_target(child_token).flatten(1))
            parents.append(frontier.repeat_interleave(child_token.shape[2], dim=1))
            depths.append(torch.full((child_score.shape[1] * child_score.shape[2],), d + 2, device=device))
            best = top_in_order(child_score.flatten(1), top_k)  # the next frontier
            row = best // child_token.shape[2]  # which fed column each new frontier node hangs off
            frontier = count + best
            hidden = out.gather(1, row[..., None].expand(-1, -1, out.shape[-1]))
            seen = seen.gather(1, row[..., None].expand(-1, -1, seen.shape[-1]))
            count += child_score.shape[1] * child_score.shape[2]
        scores, tokens, parents = torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)
        # Rerank everything generated within each row's own depth budget (so a row's tree is the
        # one it would get alone), then back to generation order (topological). Nodes past the
        # budget that still make the cut (-inf ties) are the ones the loop cuts.
        too_deep = torch.cat(depths)[None] > torch.tensor(counts, device=device)[:, None]
        keep = top_in_order(scores.masked_fill(too_deep, float("-inf")), self.tree["total_tokens"]).sort(dim=1).values
        self.last_scores = scores.gather(1, keep)
        kept_parents = []
        for row_keep, row_parents in zip(keep.tolist(), parents.tolist()):
            where = {old: new for new, old in enumerate(row_keep)}
            kept_parents.append([where[row_parents[i]] if row_parents[i] >= 0 else -1 for i in row_keep])
        nodes = keep.shape[1]
        return Proposal(tokens=tokens.gather(1, keep), counts=[nodes if c else 0 for c in counts], parents=kept_parents)

    def select(self, rows, kept) -> None:
        self.kv.select(rows, kept)
        self._real = [self._real[i] for i in kept]
        self._has = [self._has[i] for i in kept]
        if self._root is not None:
            self._root = tuple(x.index_select(0, rows.to(x.device)) for x in self._root)
        self.kv.compact_if_wasteful()

    def accepted(self, num_accepted, committed, hidden) -> None:
        # The pairs of the committed tokens: (token after each fed column, that column's feature)
        # for the fed last token and the n_b accepted drafts.
        counts = [n + 1 for n in num_accepted]
        device = self._param().device
        ids, lo = right_align(committed.to(device), counts)
        features, _ = right_align(self._features(hidden), counts)
        width = ids.shape[1]
        offsets = torch.arange(width, device=device)[None] - torch.tensor(lo, device=device)[:, None]
        positions = torch.where(offsets >= 0, torch.tensor(self._real, device=device)[:, None] + offsets, 0)
        self._pending = (ids, features, positions, lo)


def eagle_rows(head, target, name: str, options=None) -> dict:
    """The registry's rows of an EAGLE head: NAME-chain, and NAME-tree (an EAGLE-2 dynamic tree)
    when `options.tree` is "DEPTH,TOP_K,TOTAL_TOKENS"."""
    typical = options.typical if options is not None else None
    rows = {f"{name}-chain": EagleDrafter(head, name=f"{name}-chain", typical=typical)}
    if options is not None and options.tree:
        tree = parse_eagle_tree(options.tree)
        rows[f"{name}-tree"] = EagleDrafter(head, tree=tree, name=f"{name}-tree", typical=typical)
    return rows


def parse_eagle_tree(text: str) -> dict:
    """ "DEPTH,TOP_K,TOTAL_TOKENS" -> the EagleDrafter tree options; ValueError naming what was expected."""
    try:
        depth, top_k, total = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"tree {text!r}: expected DEPTH,TOP_K,TOTAL_TOKENS, e.g. 4,4,16") from None
    if min(depth, top_k, total) < 1:
        raise ValueError(f"tree {text!r}: DEPTH, TOP_K and TOTAL_TOKENS must all be >= 1")
    return {"depth": depth, "top_k": top_k, "total_tokens": total}
