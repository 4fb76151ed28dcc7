"""Drafters: what proposes tokens for the target to verify, each written once, for B rows.

The contract (the loop in `decoding/loop.py` drives it):

    drafter.prepare(batch, capacity, compile, k, sampling, logits)   before the clock: capacity
                                         (columns per row) is None when not known (the store then
                                         grows as it fills); `logits`:
                                         whether proposals carry their raw logits; returns the
                                         seconds spent compiling
    drafter.start(prompts, prefill, vocab_size)   prefill: {layer: [B, P, H]} target states of
                                         every prompt token but the last (rows right-aligned)
    proposal = drafter.propose(contexts, num_tokens, sampling, generators)
    drafter.select(rows, kept)           rows that finished left the batch
    drafter.accepted(num_accepted, committed, hidden)

`contexts[b]`: row b's tokens so far (host list). `num_tokens[b]`: the most drafts (a tree: the
deepest depth) row b may get. `committed [B, W]`: row b's tokens emitted this call (its n_b
accepted drafts, then the correction/bonus token) in its first n_b + 1 columns. `hidden[layer]
[B, W', H]`: the target's states of row b's committed fed columns (the fed last token, then the
accepted path) in its first n_b + 1 columns.

A `Proposal` carries tokens [B, N] (row b's first counts[b]), and either `probs` [B, N, V], the
exact distributions they were drawn from, or `probs=None` for deterministic proposals (q = 1 on
each token). `logits`: the raw (T = 1) logits, for the KL/TV report only (when `prepare` asked). Trees:
`parents[b][i]` is the index of row b's node i's parent, or -1 for a child of the last committed
token; nodes in topological order, deterministic. `parents=None`: every row is a chain.

Hidden states: a drafter that reads the TARGET's states names them in `target_layers` (HF
`output_hidden_states` ids: 0 = embeddings, L = the last layer after the final norm).
`proposal_sizes(k)`: the usual sizes of a proposal (tokens of a chain, nodes of a tree), the
largest bounding all: the static path sizes its store with it and compiles 1 + each size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from draftsmith.decoding.kv import KVStore, capacity_for, model_cache
from draftsmith.decoding.masks import chain_attend
from draftsmith.decoding.sampling import SamplingConfig, draw_rows
from draftsmith.decoding.target import left_aligned, max_positions, right_aligned


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, N] long (any device); row b's are its first counts[b]
    counts: list[int]  # tokens (a tree: nodes) proposed per row
    probs: torch.Tensor | None = None  # [B, N, V] what each token was drawn from; None = deterministic
    logits: torch.Tensor | None = None  # [B, N, V] raw logits, for the distance report
    parents: list[list[int]] | None = None  # trees: per row, each node's parent (-1 = the root)

    @classmethod
    def empty(cls, rows: int, device=None) -> Proposal:
        return cls(tokens=torch.zeros(rows, 0, dtype=torch.long, device=device), counts=[0] * rows)


class Drafter:
    """Base class: no state, no limits; subclasses implement `propose` and what they keep."""

    name = "drafter"
    #: Target hidden-state ids (HF numbering, 0..L) this drafter reads.
    target_layers: tuple[int, ...] = ()
    #: (epsilon, delta): verify with typical acceptance (`tree.verify_tree_typical`) instead of
    #: the lossless rule.
    #: LOSSY at T > 0 (the output is no longer the target's distribution); None = lossless.
    typical: tuple[float, float] | None = None
    #: The deepest proposal a tree drafter makes (None: as deep as asked).
    max_depth: int | None = None
    #: Its proposals are trees (`Proposal.parents`), not chains.
    trees = False
    #: The draft cost is per step whatever K (every position in one forward), not per drafted token.
    cost_per_step = False

    def max_positions(self) -> int | None:
        """Longest prompt + new tokens the drafter can place (None = no limit of its own)."""
        return None

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return (num_tokens,)

    #: Whether proposals carry their raw logits (set by `prepare`: only the distance report reads them).
    logits = False

    def prepare(
        self, batch: int, capacity: int | None, compile, num_tokens: int, sampling: SamplingConfig, logits: bool = False
    ) -> float:
        self.logits = logits
        return 0.0

    def start(self, prompts: list[list[int]], prefill: dict[int, torch.Tensor], vocab_size: int) -> None:
        pass

    def modules(self) -> list[torch.nn.Module]:
        """The modules its proposals run (its attributes), whose CPU linears `decode` picks (`cpu_linears`)."""
        return [value for value in vars(self).values() if isinstance(value, torch.nn.Module)]

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        raise NotImplementedError

    def select(self, rows: torch.Tensor, kept: list[int]) -> None:
        pass

    def accepted(self, num_accepted: list[int], committed: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        pass


class HeadDrafter(Drafter):
    """A drafter whose head reads the target's hidden states at `head.config.aux_layer_ids` (one
    or several target layers): it keeps the head, checks that it names its layers, projects them,
    and keeps the head's KV store (`kv`, role `kind.lower()`): sized on the static path, where its
    step (`_step`, a cache call of `kv.py`) `compile` compiles per width, else grown as it fills."""

    def __init__(self, head: torch.nn.Module, name: str, kind: str):
        self.head, self.name, self.kind = head, name, kind
        self.role = kind.lower()  # the head's store, and its compiled steps' key
        self.target_layers = tuple(int(i) for i in head.config.aux_layer_ids)
        if not self.target_layers:
            raise ValueError(
                f"head.config.aux_layer_ids is empty: the {kind} head must name the target layers it reads"
            )
        self.kv: KVStore | None = None
        self._capacity, self._compile = None, False  # the store's columns (None: grown as it fills), set by `prepare`

    def max_positions(self) -> int | None:
        return max_positions(self.head.config)

    def _param(self) -> torch.Tensor:
        return next(self.head.parameters())

    def _features(self, hidden: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target's states of `target_layers`, concatenated on the head's device and dtype, projected."""
        param = self._param()
        aux = torch.cat([hidden[i].to(device=param.device, dtype=param.dtype) for i in self.target_layers], dim=-1)
        return self.head.project(aux)

    def _step(self, ids, positions, mask, cache, features):
        """The forward of a head taking (ids, features) as a cache call (`kv.py`): (out_hidden g, logits)."""
        return self.head(ids, features, position_ids=positions, attention_mask=mask, cache=cache)

    def _prepare_store(
        self, batch: int, capacity: int | None, compile, logits: bool, looks: dict[int, int], extra: int
    ) -> float:
        """`prepare` of the head's store: grown as it fills when `capacity` (the target's columns
        per row) is None, else sized with room for `extra` columns more (what one proposal feeds past a
        row's real ones), its step warmed (compiled with `compile`) for each width of `looks`
        (`warm_up_call`: width -> lookback), with features [batch, width, hidden] as its input.
        Returns the seconds spent compiling."""
        self.logits, self._compile = logits, compile
        self._capacity = None if capacity is None else capacity_for(capacity + extra)
        if self._capacity is None:
            return 0.0
        kv = model_cache(self.head, self.role, batch, self._capacity, compile)
        param, size = self._param(), self.head.config.hidden_size
        inputs = lambda width: (torch.zeros(batch, width, size, device=param.device, dtype=param.dtype),)  # noqa: E731
        return kv.warm_up_call(self._step, looks, self.role, inputs)

    def _new_store(self, batch: int) -> KVStore:
        """The head's empty store for a request of `batch` rows (`start`), sized as `prepare` chose."""
        return model_cache(self.head, self.role, batch, self._capacity, self._compile)


class OnePassDrafter(HeadDrafter):
    """A head that drafts every position of a call in ONE forward (a one-pass head), over a
    KV store (`kv.py`) of its rows' context columns: row b has `_real[b]` columns in the cache and
    `_pending[b]`, what the verifications returned since, fed with the next call's forward (each
    column once). Every forward feeds [the new context columns | a fixed suffix of `_suffix` columns
    (the head's block of placeholder inputs)] and keeps the real context columns only. On the
    compiled path the context is widened (holes on the left, as in right-aligned rows) to the
    compiled width, so a compiled step runs exactly as it was traced, never recompiled:
    `prepare` compiles ONE width, K + 1 new columns (the fed last token and up to K accepted
    drafts) + the suffix, which every call after the prompt's fits (the prompt's first catch-up
    is wider and runs uncompiled). One width rather than a chained head's 1..K + 1: the suffix is
    there anyway and a compiled step's attention reads the whole buffer whatever the width, so the
    <= K padding columns cost a little per-column arithmetic, while each width more costs a
    compile. A subclass builds the forward (`propose`) and what it keeps (`accepted`)."""

    cost_per_step = True

    def __init__(self, head: torch.nn.Module, name: str, kind: str):
        super().__init__(head.eval(), name, kind)
        self.mask_token_id = int(head.config.mask_token_id)
        self._suffix = 0  # columns each forward feeds after the context (set by a subclass / `prepare`)
        self._real: list[int] = []  # context columns in the cache per row (= the next context position)
        self._pending: list[list] = []  # per row, the pieces not yet fed

    def _suffix_for(self, size: int) -> int:
        """The suffix columns for proposals of up to `size` tokens."""
        raise NotImplementedError

    def prepare(self, batch, capacity, compile, num_tokens, sampling, logits=False) -> float:
        size = max(self.proposal_sizes(num_tokens))
        self._suffix = self._suffix_for(size)
        looks = {size + 1 + self._suffix: 0}  # every later call is padded to it (class docstring)
        return self._prepare_store(batch, capacity, compile, logits, looks, size + 1 + self._suffix)

    def _start_rows(self, batch: int, vocab_size: int) -> None:
        """An empty cache and nothing pending for `batch` rows of a target with `vocab_size` outputs."""
        if vocab_size != self.head.config.vocab_size:
            raise ValueError(
                f"{self.kind} head drafts over {self.head.config.vocab_size} tokens, the target outputs {vocab_size}"
            )
        self.kv = self._new_store(batch)
        self._real = [0] * batch
        self._pending = [[] for _ in range(batch)]

    def _check_in_step(self, contexts, fresh: list[int], what: str) -> None:
        """RuntimeError unless each row's cached and `fresh` columns (its `what`) cover all of its
        context but the last token."""
        for b, context in enumerate(contexts):
            if self._real[b] + fresh[b] != len(context) - 1:
                raise RuntimeError(
                    f"{self.kind} drafter out of step: row {b} has {what} of {self._real[b] + fresh[b]} positions, "
                    f"its context {len(context)} tokens (was a verification's `accepted` skipped?)"
                )

    def _context_width(self, fresh: list[int]) -> int:
        """The context columns of a forward feeding row b `fresh[b]` new ones: the narrowest
        compiled width (less the tail) that holds them all, else the widest row's (uncompiled);
        the cache has room for them and the tail afterwards."""
        widths = [w - self._suffix for w in self.kv.compiled_widths(self.role) if w - self._suffix >= max(fresh)]
        width = min(widths, default=max(fresh))
        self.kv.reserve(width + self._suffix)
        return width

    def _forward(self, ids, positions, attend, features, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The head's step (`_step`) over the fed columns ids [B, W] at positions [B, W] with
        `features [B, W, H]`, `attend [B, W, W]`; row b's cache keeps the columns `keep [B, W]` marks."""
        out = self.kv.run(self._step, ids, positions, attend, features, key=self.role)
        self.kv.commit(keep.cpu())
        return out

    def _fed(self, fresh: list[int]) -> None:
        """After a forward fed each row's `fresh` pending columns (and `kv.commit` kept them)."""
        self._real = [r + n for r, n in zip(self._real, fresh)]
        self._pending = [[] for _ in self._pending]
        self.kv.compact_if_wasteful()

    def select(self, rows, kept) -> None:
        self.kv.select(rows, kept)
        self._real = [self._real[i] for i in kept]
        self._pending = [self._pending[i] for i in kept]
        self.kv.compact_if_wasteful()

    def _one_pass_proposal(
        self, raw: torch.Tensor, counts: list[int], sampling: SamplingConfig, generators
    ) -> Proposal:
        """The proposal of a head that drafts every position in one forward (a one-pass head):
        raw [B, K, V] target-vocabulary logits, position k drawn from its own q_k (which depends on
        the context only, so speculative sampling with q_k stays exact); greedy takes the argmax.
        Positions past a row's count take the argmax (never verified) and leave its generator alone."""
        logits = raw if self.logits else None
        if sampling.greedy:
            return Proposal(tokens=raw.argmax(-1), counts=counts, logits=logits)
        q = sampling.probs(raw)  # [B, K, V]: exactly what each position is drawn from
        tokens = torch.stack([draw_rows(q[:, k], generators, [k < c for c in counts]) for k in range(raw.shape[1])], 1)
        return Proposal(tokens=tokens, counts=counts, probs=q, logits=logits)


class DraftModelDrafter(Drafter):
    """Any HF causal LM that shares the target's vocabulary, over its own ragged KV cache.

    It samples with the target's settings (temperature, top-k, top-p) and returns the warped
    distribution it sampled from as q. Before drafting, each row feeds the tokens its cache
    lacks (the whole prompt at first, then the correction token, or the last draft and the
    bonus); the drafts x_1..x_{K-1} enter the cache while drafting, and after verification row b
    keeps the first n_b of them. Logits are aligned to the target's vocabulary (padded with
    -inf, or cut) so that q and p cover the same tokens. With `compile` a greedy proposal is ONE
    call (the catch-up and every draft step, `compiler.make_chain`), compiled for catch-ups of 1 and 2 tokens
    (after a correction; after a bonus), sampled proposals' width-1 and width-2 steps instead
    (the draws come from the rows' generators between steps).
    """

    def __init__(self, model: PreTrainedModel, name: str = "draft"):
        self.model = model.eval()
        self.name = name
        self.kv: KVStore | None = None
        self._capacity, self._compile = None, False
        self.model_vocab = self.vocab_size = model.get_output_embeddings().weight.shape[0]  # the target's after start
        self._spec_start = 0  # first cache column of this call's drafts
        self._bias = None  # greedy chains: -inf on the draft ids past the target's vocabulary

    def max_positions(self) -> int | None:
        return max_positions(self.model.config)

    def prepare(self, batch, capacity, compile, num_tokens, sampling, logits=False) -> float:
        self._capacity, self._compile, self.logits = capacity, compile, logits
        if capacity is None:
            return 0.0
        kv = model_cache(self.model, "draft", batch, capacity, compile)
        if sampling.greedy:
            return kv.warm_up([1, 2], chain=num_tokens, vocab=self.model_vocab, logits=logits)
        return kv.warm_up([1, 2])

    def start(self, prompts, prefill, vocab_size) -> None:
        self.vocab_size = vocab_size
        self.kv = model_cache(self.model, "draft", len(prompts), self._capacity, self._compile)
        self._bias = torch.zeros(self.model_vocab, device=self.model.device)
        self._bias[vocab_size:] = float("-inf")

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[..., : self.vocab_size] if extra < 0 else logits

    def _forward(self, ids, positions, lo=None, logits_to_keep=0):
        attend = chain_attend(ids.shape[1], lo, None, ids.shape[0], ids.device) if lo and any(lo) else None
        out = self.kv.forward(self.model, ids, positions, attend, logits_to_keep=logits_to_keep)
        self.kv.commit_spans(ids.shape[1], lo, None)
        return out.logits[:, -1]

    def _catch_up_left_aligned(self, pieces: list[list[int]], counts: list[int]) -> torch.Tensor:
        """The catch-up of a draft with recurrent layers once its rows hold tokens: padding after each
        row's tokens (its state cannot skip padding before them); the logits of each row's last."""
        ids, positions, hi = left_aligned(pieces, counts, self.model.device)
        attend = chain_attend(ids.shape[1], None, hi, ids.shape[0], ids.device)
        out = self.kv.forward(self.model, ids, positions, attend)
        self.kv.commit_spans(ids.shape[1], None, hi)
        return out.logits[torch.arange(len(hi)), torch.tensor(hi, device=out.logits.device) - 1]

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        device = self.model.device
        counts = self.kv.counts
        pieces = [c[n:] for c, n in zip(contexts, counts)]  # the tokens each row's cache lacks
        width = max(num_tokens)
        self.kv.reserve(max(map(len, pieces)) + width - 1)  # room for the catch-up and the drafts: no compaction
        if self.kv.states is not None and any(counts) and len({len(p) for p in pieces}) > 1:
            logits = self._catch_up_left_aligned(pieces, counts)
        else:
            # Right-aligned, so that each row's last token is column -1.
            ids, positions, lo = right_aligned(pieces, counts, device)
            chained = self.kv.chain(ids, positions, lo, width, self._bias, self.logits) if sampling.greedy else None
            if chained is not None:  # a compiled chain: the catch-up and every draft in one call
                tokens, raw = chained
                self._spec_start = self.kv.length - (width - 1)
                raw = None if raw is None else self._aligned(raw.float())
                return Proposal(tokens=tokens, counts=list(num_tokens), logits=raw)
            logits = self._forward(ids, positions, lo, logits_to_keep=1)
        self._spec_start = self.kv.length
        self.kv.checkpoint()  # `accepted` cuts the drafts back to each row's accepted ones
        base = torch.tensor(self.kv.counts, device=device)  # position of each row's first draft
        tokens, probs, raw = [], [], []
        for i in range(width):
            logits = self._aligned(logits.float())
            if self.logits:
                raw.append(logits)
            if sampling.greedy:
                token = logits.argmax(-1)
            else:
                q = sampling.probs(logits)  # [B, V]: exactly what row b's token is drawn from
                probs.append(q)
                token = draw_rows(q, generators, [i < k for k in num_tokens])  # rows past their budget: argmax
            tokens.append(token)
            if i + 1 < width:
                logits = self._forward(token[:, None], (base + i)[:, None])
        return Proposal(
            tokens=torch.stack(tokens, dim=1),
            counts=list(num_tokens),
            probs=torch.stack(probs, dim=1) if probs else None,
            logits=torch.stack(raw, dim=1) if raw else None,
        )

    def select(self, rows, kept) -> None:
        self.kv.select(rows, kept)

    def accepted(self, num_accepted, committed, hidden) -> None:
        # The cache holds each row's context + x_1..x_{K-1}: keep the accepted ones.
        fed = self.kv.length - self._spec_start
        self.kv.retain(self._spec_start, [min(n, fed) for n in num_accepted])
        self.kv.compact_if_wasteful()


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding, per row: find the latest earlier occurrence of the context's last
    n-gram (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it.
    Deterministic (q = 1 on each token); costs no model call. Each row keeps a table of every
    n-gram but the context's last, to the end of its latest occurrence, updated with the tokens
    that arrived since the last call: a lookup costs the same at any context length."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._tables: list[dict] = []  # per row: n-gram -> the end of its latest occurrence
        self._done: list[int] = []  # per row: the ends indexed so far are 1..done

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(range(num_tokens + 1))  # whatever follows the match, or nothing

    def start(self, prompts, prefill, vocab_size) -> None:
        self._tables, self._done = [{} for _ in prompts], [0] * len(prompts)

    def select(self, rows, kept) -> None:
        self._tables, self._done = [self._tables[i] for i in kept], [self._done[i] for i in kept]

    def _lookup(self, b: int, context: list[int], num_tokens: int) -> list[int]:
        while len(self._tables) <= b:  # no `start`: a fresh table
            self._tables.append({})
            self._done.append(0)
        if self._done[b] >= len(context):  # shorter than at the last call: another request
            self._tables[b], self._done[b] = {}, 0
        table = self._tables[b]
        for end in range(self._done[b] + 1, len(context)):  # every n-gram but the context's last
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                table[tuple(context[end - n : end])] = end
        self._done[b] = len(context) - 1
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            end = table.get(tuple(context[-n:]))
            if end is not None:  # the latest match is usually the most relevant
                return context[end : end + num_tokens]
        return []

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        found = [self._lookup(b, c, k) if k > 0 else [] for b, (c, k) in enumerate(zip(contexts, num_tokens))]
        width = max(map(len, found))
        tokens = torch.tensor([f + [0] * (width - len(f)) for f in found], dtype=torch.long).view(len(found), width)
        return Proposal(tokens=tokens, counts=[len(f) for f in found])


def draft_model_rows(model, target, name: str, options=None) -> dict:
    """The registry's rows of a draft model: one chain, `name`."""
    return {name: DraftModelDrafter(model, name=name)}
