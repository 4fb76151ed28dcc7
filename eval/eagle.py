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

import weakref
from collections.abc import Callable

import torch

from draftsmith.eval.drafters import Drafter, Proposal
from draftsmith.heads.eagle import EagleCache, StaticEagleCache
from draftsmith.heads.static_target import CAPACITY_STEP, Compiler, StaticCacheOverflow, compile_mode, static_mask

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


class EagleDrafter(Drafter):
    """EAGLE-1/EAGLE-3 drafting over the target's hidden states `head.config.aux_layer_ids`.

    `head`: an `EagleHead` (see the module docstring for what is called on it).
    `tree`: None for a chain of argmax tokens, or the EAGLE-2 dict `{"depth", "top_k",
    "total_tokens"}`. `typical=(epsilon, delta)`: Medusa's LOSSY typical acceptance (as for
    `MedusaDrafter`); None = lossless.
    `cache_factory`: returns an empty draft KV cache (default `heads.eagle.EagleCache`); tests
    hand in a stand-in head with its own cache.
    `static_cache=True` drafts over a preallocated cache (`heads.eagle.StaticEagleCache`);
    `compile=True` (or a mode of `heads.static_target.COMPILE_MODES`; implies the static
    cache) also compiles each proposal, the catch-up and all its drafting steps, into ONE call
    (see `_StaticDraft`). Both need a head with `decode` (`EagleHead` has it).
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
        static_cache: bool = False,
        compile: bool | str = False,
    ):
        self.head = head
        self.target_layers = tuple(int(i) for i in head.config.aux_layer_ids)
        if not self.target_layers:
            raise ValueError("head.config.aux_layer_ids is empty: the EAGLE head must name the target layers it reads")
        self.tree = None if tree is None else _check_tree(tree)
        self.name = name
        self.typical = tuple(typical) if typical is not None else None
        self._new_cache = cache_factory or EagleCache
        self.cache = self._new_cache()
        self.fast = _static_draft(head, compile) if static_cache or compile else None
        self._chain_length = 0  # the fast path's chain length (set by `reserve`)
        self.last_scores: torch.Tensor | None = None  # tree: cumulative log q of the last proposal's nodes
        self._reset_state()

    @property
    def max_depth(self) -> int | None:
        """K for this drafter: a tree reaches depth `depth + 1` (the root's top-k, then `depth`
        expansions); a chain has no limit of its own (None: as long as the decoder asks)."""
        return None if self.tree is None else self.tree["depth"] + 1

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens if self.tree is None else self.tree["total_tokens"],)

    def reserve(self, max_context: int, num_tokens: int, sampling) -> float:
        """The fast path: size the static cache for a request and compile its proposals."""
        if self.fast is None:
            return 0.0
        self._chain_length = num_tokens
        return self.fast.reserve(max_context, num_tokens, self._shape(num_tokens))

    def _shape(self, num_tokens: int) -> tuple:
        """What a proposal of `num_tokens` drafts runs on the fast path: ("chain", k) (the
        reserved length: a shorter chain is its prefix) or ("tree", depth, top_k)."""
        if self.tree is None:
            return ("chain", max(num_tokens, self._chain_length))
        return ("tree", min(self.tree["depth"], num_tokens - 1), self.tree["top_k"])

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
        if self.fast is None and self.cache.seq_len > self._real:
            self.cache.crop(self._real)  # (the static cache just overwrites past `_real`)

    def accepted(self, num_accepted: int) -> None:
        self._drop_speculation()

    def accepted_path(self, path: list[int]) -> None:
        self._drop_speculation()

    # ------------------------------------------------------------------------- drafting

    def _new_pairs(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed pairs the cache lacks: (ids [n], features [n, H]), taken off the
        pending features; `_real` is NOT advanced (the caller feeds them)."""
        available = min(self._num_features, context.shape[0] - 1)  # pairs t = 0 .. available-1
        count = max(0, available - self._real)
        if not count:
            return context[:0], None
        features = torch.cat(self._pending)
        self._pending = [features[count:]] if count < features.shape[0] else []
        return context[self._real + 1 : available + 1].to(features.device), features[:count]

    def _catch_up(self, context: torch.Tensor) -> None:
        """Feed every committed pair the cache lacks in one forward; keep the last output."""
        self._drop_speculation()
        ids, features = self._new_pairs(context)
        if features is None:
            return
        positions = torch.arange(self._real, self._real + ids.shape[0], device=ids.device)
        g, logits = self.head(ids[None], features[None], position_ids=positions[None], cache=self.cache)
        self._root = (g[0, -1], logits[0, -1])
        self._real += ids.shape[0]

    def _step(self, ids, hidden, offset, seen):
        """Feed w speculative rows (ids [1, w], hidden [1, w, H]) at position `_real + offset`;
        row i sees the real cache and the speculative rows fed so far (these included) that
        `seen[i]` marks. The draft's `step` for `_greedy_chain` / `_expand_tree`."""
        width, dtype = ids.shape[1], self._param().dtype
        mask = torch.zeros(1, 1, width, self.cache.seq_len + width, dtype=dtype, device=ids.device)
        mask[0, 0, :, self._real :] = torch.where(seen, 0.0, torch.finfo(dtype).min)
        positions = torch.full((1, width), self._real + offset, device=ids.device)
        return self.head(ids, hidden, position_ids=positions, attention_mask=mask, cache=self.cache)

    @torch.inference_mode()
    def propose(self, context, num_tokens, sampling, generator=None) -> Proposal:
        if self.fast is not None:
            return self._propose_static(context, num_tokens)
        self._catch_up(context)
        if self._root is None or num_tokens < 1:  # a one-token prompt: nothing observed yet
            return Proposal(tokens=context.new_empty(0))
        g, logits = self._root
        if self.tree is None:
            return self._chain_proposal(context, *_greedy_chain(self._step, g, logits, num_tokens, self.head.draft_to_target))
        depth, top_k = self._shape(num_tokens)[1:]
        return self._tree_proposal(context, *_expand_tree(self._step, g, logits, depth, top_k, self.head.draft_to_target))

    def _propose_static(self, context, num_tokens) -> Proposal:
        ids, features = self._new_pairs(context)
        if num_tokens < 1 or (self._root is None and features is None):
            if features is not None:  # catch up all the same
                self._root = self.fast.feed(self._real, ids, features)
                self._real += ids.shape[0]
            return Proposal(tokens=context.new_empty(0))
        shape = self._shape(num_tokens)
        out, root = self.fast.propose(shape, self._real, ids, features, self._root)
        self._root = root
        self._real += ids.shape[0]
        if shape[0] == "chain":
            tokens, raw = out
            return self._chain_proposal(context, tokens[:num_tokens], raw[:num_tokens])
        return self._tree_proposal(context, *out)

    def _chain_proposal(self, context, tokens, raw) -> Proposal:
        return Proposal(tokens=tokens.to(context.device), logits=self.head.target_logits(raw).float())

    def _tree_proposal(self, context, scores, tokens, parents) -> Proposal:
        # Rerank everything generated; order by (score desc, depth asc, id asc) puts every
        # parent before its children (score never increases along a path), so the kept set is
        # closed under ancestors. Then back to generation order: topological.
        keep = sorted(_top_in_order(scores, self.tree["total_tokens"]).tolist())
        parents = parents.tolist()
        where = {old: new for new, old in enumerate(keep)}
        kept_parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in keep]
        index = torch.tensor(keep, device=scores.device)
        self.last_scores = scores[index]
        return Proposal(tokens=tokens[index].to(context.device), parents=kept_parents)


def _greedy_chain(step, g, logits, num_tokens: int, to_target) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain: the draft's argmax at every step, each drafted token fed back with the draft's
    own g one position further on. Returns target tokens [num_tokens] and the draft logits
    [num_tokens, draft vocab] they were taken from."""
    drafted, raw = [], []
    for i in range(num_tokens):
        token = to_target(logits.argmax(-1, keepdim=True))  # the head reads target ids
        drafted.append(token)
        raw.append(logits)
        if i + 1 < num_tokens:
            seen = torch.ones(1, i + 1, dtype=torch.bool, device=token.device)  # every row so far
            out, step_logits = step(token[None], g[None, None], i, seen)
            g, logits = out[0, -1], step_logits[0, -1]
    return torch.cat(drafted), torch.stack(raw)


def _expand_tree(step, g_root, logits, depth: int, top_k: int, to_target):
    """EAGLE-2's expansion (module docstring, steps 1 and 2): every generated node's cumulative
    log q, target token and parent (-1 = the root), in generation order."""
    device = g_root.device
    logq = torch.log_softmax(logits.float(), -1).clamp(max=0.0)
    score, token = logq.topk(min(top_k, logq.shape[-1]))
    token = to_target(token)
    scores, tokens, parents = [score], [token], [torch.full_like(token, -1)]
    frontier = torch.arange(token.shape[0], device=device)  # node ids of the current frontier
    hidden = g_root.expand(token.shape[0], -1)  # what each frontier node reads: its parent's g
    seen = torch.zeros(token.shape[0], 0, dtype=torch.bool, device=device)  # ancestors among fed rows
    count = token.shape[0]
    for d in range(depth):
        # The frontier sees the real cache, its ancestors (earlier fed rows) and itself.
        seen = torch.cat([seen, torch.eye(frontier.shape[0], dtype=torch.bool, device=device)], dim=1)
        out, step_logits = step(torch.cat(tokens)[frontier][None], hidden[None], d, seen)
        logq = torch.log_softmax(step_logits[0].float(), -1).clamp(max=0.0)
        child_logq, child_token = logq.topk(min(top_k, logq.shape[-1]), dim=-1)  # [width, k]
        child_token = to_target(child_token)
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
    return torch.cat(scores), torch.cat(tokens), torch.cat(parents)


def _top_in_order(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores; among equal scores the smaller index wins (a stable
    sort: generated ids grow with depth, so a parent beats a child of equal score)."""
    order = torch.sort(scores, descending=True, stable=True).indices
    return order[: min(k, scores.numel())]


def _speculative_rows(shape: tuple) -> int:
    """Draft-cache rows a proposal of `shape` writes past the real pairs: a chain's k - 1 fed
    drafts, a tree's depth x top_k frontier rows."""
    return shape[1] - 1 if shape[0] == "chain" else shape[1] * shape[2]


_STATIC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # head -> {compile mode: _StaticDraft}


def _static_draft(head: torch.nn.Module, compile: bool | str) -> _StaticDraft:
    """The head's static state for `compile`, made once (its compiled proposals are the
    expensive part, as `heads.static_target.static_adapter`): every drafter over the head
    shares it, so use them one sequence at a time."""
    slots = _STATIC.setdefault(head, {})
    mode = compile_mode(compile)
    if mode not in slots:
        slots[mode] = _StaticDraft(head, compile)
    return slots[mode]


class _StaticDraft:
    """The head over a preallocated cache, each proposal one (compiled) call.

    A proposal feeds the committed pairs the cache lacks (the catch-up: n + 1 after n accepted
    drafts, so at most K + 1) and then drafts, all at explicit slots of a
    `heads.eagle.StaticEagleCache`: real pairs at slots < `real`, speculative rows after them
    (overwritten by the next proposal). The catch-up is padded to a fixed `width` = K + 1 rows
    (padding rows write junk past the real pairs, overwritten by the drafting rows, and are
    never read), so one compiled function serves every proposal of a shape (`("chain", k)` or
    `("tree", depth, top_k)`): catch-up, k steps or the whole tree expansion, in one graph.
    A longer catch-up (the first, after the prompt) feeds its head uncompiled first; a shape
    that was not warmed (a shorter tree at the end of a request) runs the same function
    uncompiled; a shorter chain is the prefix of the warmed one."""

    def __init__(self, head: torch.nn.Module, compile: bool | str):
        if not callable(getattr(head, "decode", None)):
            raise TypeError(
                f"static_cache/compile need a head with decode(input_ids, hidden, position_ids, mask, cache) "
                f"(draftsmith.heads.eagle.EagleHead); {type(head).__name__} has none"
            )
        param = next(head.parameters())
        self.head, self.device, self.dtype = head, param.device, param.dtype
        self.compiler = Compiler(compile, self.device, f"the EAGLE head ({type(head).__name__})")
        self.cache, self.width = None, 1
        self._compiled: dict[tuple, object] = {}

    def reserve(self, max_context: int, num_tokens: int, shape: tuple) -> float:
        """Room for `max_context` pairs plus a proposal of `num_tokens`, catch-ups of up to
        num_tokens + 1 pairs; compile `shape`'s proposal. Returns the seconds spent compiling."""
        width = max(self.width, num_tokens + 1)
        capacity = -(-(max_context + width + _speculative_rows(shape)) // CAPACITY_STEP) * CAPACITY_STEP
        if self.cache is None or capacity > self.cache.capacity or width != self.width:
            self.cache, self.width = StaticEagleCache(capacity), width
            self._compiled.clear()  # compiled against the old buffers
        if not self.compiler.enabled or shape in self._compiled:
            return 0.0
        before = self.compiler.seconds
        ids = torch.zeros(width, dtype=torch.long, device=self.device)
        features = torch.zeros(width, self.head.config.hidden_size, dtype=self.dtype, device=self.device)
        root = (features[0], torch.zeros(self.head.config.draft_vocab_size, dtype=self.dtype, device=self.device))
        with torch.inference_mode():
            self.propose(shape, 0, ids, features, root)  # eager first: allocates the buffers
            compiled = self.compiler.wrap(self._function(shape))
            inputs = self._inputs(0, ids, features)
            if self.compiler.first_calls(f"an EAGLE {shape[0]} proposal", compiled, *inputs):
                self._compiled[shape] = compiled
        return self.compiler.seconds - before

    def _step(self, real, ids, hidden, offsets, seen):
        """Feed w rows at slots real + fed - w.. (fed = seen's width: the rows fed since `real`,
        these included) at positions real + offsets; row i sees the slots < real and the fed
        rows seen[i] marks."""
        width, fed = ids.shape[1], seen.shape[1]
        mask = static_mask(real, seen, self.cache.capacity, self.dtype)
        positions = (real + offsets).reshape(1, -1).expand(1, width)
        return self.head.decode(ids, hidden, positions, mask, self.cache.at(real + fed - width))

    def _stepper(self, real):
        """The `step` of `_greedy_chain` / `_expand_tree` for speculative rows after `real` pairs."""
        return lambda ids, hidden, offset, seen: self._step(real, ids, hidden, offset, seen)

    def feed(self, real: int, ids, features):
        """Feed committed pairs at `real` (uncompiled); the (g, logits) of the last one."""
        n = ids.shape[0]
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        g, logits = self._step(real, ids[None], features[None], torch.arange(n, device=self.device), causal)
        return g[0, -1], logits[0, -1]

    def _function(self, shape: tuple):
        """The proposal of `shape`, as one function of tensors: (catch-up ids [1, width],
        features [1, width, H], real, count) -> (the drafting's outputs, root g, root logits)."""
        kind, *args = shape
        width = self.width
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        offsets = torch.arange(width, device=self.device)
        to_target = self.head.draft_to_target

        def proposal(ids, features, real, count):
            g, logits = self._step(real, ids, features, offsets, causal)
            last = (count - 1).view(1)
            g, logits = g[0].index_select(0, last)[0], logits[0].index_select(0, last)[0]
            step = self._stepper(real + count)
            if kind == "chain":
                return _greedy_chain(step, g, logits, args[0], to_target), g, logits
            return _expand_tree(step, g, logits, *args, to_target), g, logits

        return proposal

    def _inputs(self, real: int, ids, features):
        count = ids.shape[0]
        if count < self.width:
            ids = torch.cat([ids, ids.new_zeros(self.width - count)])
            features = torch.cat([features, features.new_zeros(self.width - count, features.shape[1])])
        tensor = lambda v: torch.tensor(v, dtype=torch.long, device=self.device)  # noqa: E731
        return ids[None], features[None], tensor(real), tensor(count)

    def propose(self, shape: tuple, real: int, ids, features, root):
        """Feed the new pairs (ids [n], features [n, H]) at `real` and draft a proposal of
        `shape`; returns (its outputs, the new root (g, logits))."""
        if self.cache is None:
            raise RuntimeError("reserve() the static EAGLE cache before proposing")
        count = ids.shape[0]
        slots = real + max(count, self.width) + _speculative_rows(shape)
        if slots > self.cache.capacity:
            raise StaticCacheOverflow(
                f"static EAGLE cache overflow: {real} pairs held, {count} new and a {shape[0]} proposal need {slots} "
                f"slots, but the cache was preallocated for {self.cache.capacity}. Reserve room before the request "
                "(drafter.reserve(max_context, num_tokens, sampling)); nothing was written."
            )
        if count > self.width:  # feed the head of a long catch-up uncompiled
            extra = count - self.width
            self.feed(real, ids[:extra], features[:extra])
            real, ids, features, count = real + extra, ids[extra:], features[extra:], self.width
        if count == 0:  # nothing new (no pair since the last proposal): draft from the root
            g, logits = root
            step = self._stepper(real)
            if shape[0] == "chain":
                return _greedy_chain(step, g, logits, shape[1], self.head.draft_to_target), root
            return _expand_tree(step, g, logits, *shape[1:], self.head.draft_to_target), root
        fn = self._compiled.get(shape) or self._function(shape)
        out, g, logits = fn(*self._inputs(real, ids, features))
        if self.device.type == "cuda" and shape in self._compiled:  # CUDA graph outputs are reused
            out, g, logits = tuple(t.clone() for t in out), g.clone(), logits.clone()
        return out, (g, logits)
