"""Drafters: what proposes tokens for the target to verify.

The contract (one sequence at a time; the decoder drives it):

    drafter.reserve(max_context, k, sampling)   before `start`: contexts reach max_context tokens,
                                                proposals k (a drafter with preallocated or
                                                compiled state sizes and compiles it here)
    drafter.start(prompt_ids)                   a new sequence begins
    drafter.observe(hidden)                     target states of the tokens just committed
                                                (only if `target_layers` is non-empty)
    proposal = drafter.propose(context, k, sampling, generator)
    drafter.accepted(n)                         n of the proposed tokens were kept (a chain)
    drafter.accepted_path(path)                 the accepted nodes, root to leaf (a tree)

`context` is every token so far (prompt + emitted). A proposal carries the tokens, and either
the exact distributions `probs` they were drawn from, or `probs=None` for a deterministic
proposal (q = 1 on each proposed token). Optionally `logits`: the drafter's raw (T=1)
logits, used only for the KL/TV report. A drafter may propose fewer than k tokens, or none.

Trees (Medusa, EAGLE): `parents[i]` is the index of node i's parent, or -1 for a child of the
last committed token; nodes come in topological order and are deterministic (`probs=None`).
`k` is then the maximum depth. A chain is the tree in which every node's parent is the node
before it (`parents=None` means exactly that).

Hidden states: a drafter that reads the TARGET's hidden states (Medusa, EAGLE) names them in
`target_layers` (HF `output_hidden_states` ids: 0 = embeddings, L = last layer after the final
norm). The decoder requests them in the prefill and every verification forward and calls
`observe({layer: [m, H]})` with the states of the tokens that forward committed, in order:
after the prefill every prompt token but the last; after a verification the fed last token,
then the accepted drafts (m = accepted + 1). `observe` comes before `accepted`.

`proposal_sizes(k)` lists the sizes a proposal for k usually has (tokens of a chain, nodes of
a tree), the largest being the most it can hold: the static-cache decoder sizes its cache with
the largest and compiles one verification width per size (1 + size; other sizes are padded up).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from draftsmith.eval.sampling import SamplingConfig, draw
from draftsmith.heads.static_target import Compiler, compile_mode, static_adapter
from draftsmith.heads.target import CausalLMAdapter


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] long, on the drafter's device
    probs: torch.Tensor | None = None  # [k, V] exactly what each token was drawn from
    logits: torch.Tensor | None = None  # [k, V] raw logits for distance reports
    parents: list[int] | None = None  # tree: parent index per node (-1 = the root); None = chain

    def __len__(self) -> int:
        return self.tokens.shape[0]


class Drafter:
    """Base class; subclasses implement `propose` and, if they keep state, `start`/`accepted`."""

    name = "drafter"
    #: True when proposals are deterministic (no distribution): q = 1 on each token.
    deterministic = False
    #: Target hidden-state ids (HF numbering, 0..L) this drafter reads through `observe`.
    target_layers: tuple[int, ...] = ()
    #: (epsilon, delta): verify with Medusa's typical acceptance instead of the lossless rule.
    #: LOSSY (the output is no longer the target's distribution); None = lossless.
    typical: tuple[float, float] | None = None

    def reserve(self, max_context: int, num_tokens: int, sampling: SamplingConfig) -> float:
        """Called once per request, before `start`: contexts will reach `max_context` tokens and
        proposals `num_tokens`, under `sampling`. Returns the seconds spent compiling (kept out
        of decoding time)."""
        return 0.0

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        """The sizes a proposal for `num_tokens` usually has; the largest bounds them all."""
        return (num_tokens,)

    def start(self, prompt_ids: torch.Tensor) -> None:
        pass

    def propose(
        self,
        context: torch.Tensor,
        num_tokens: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None = None,
    ) -> Proposal:
        raise NotImplementedError

    def accepted(self, num_accepted: int) -> None:
        pass

    def accepted_path(self, path: list[int]) -> None:
        """A tree proposal kept the nodes `path` (root to leaf; empty = none)."""
        self.accepted(len(path))

    def observe(self, hidden: dict[int, torch.Tensor]) -> None:
        """States [m, H] of the target layers in `target_layers` for the m tokens just committed."""


class DraftModelDrafter(Drafter):
    """Any HF causal LM that shares the target's vocabulary, with its own KV cache.

    The draft samples with the target's sampling settings (same temperature, top-k, top-p) and
    returns the warped distribution it sampled from as q, so q is by construction the
    distribution of the proposed token. `vocab_size` aligns the draft's logits to the
    target's when one of them pads its embedding matrix (tokens past the tokenizer never occur).

    `static_cache=True` drafts over a preallocated KV cache; `compile=True` (or a mode of
    `heads.static_target.COMPILE_MODES`; implies the static cache) also compiles the draft's
    forwards (`heads/static_target.py`). Greedy proposals then take ONE call each (the catch-up
    and all k steps in one graph, `greedy_chain`); sampled ones go step by step (the sampling
    draws from the decoder's generator between steps). The adapter is shared by every drafter
    over the same model (made once, compiled once); `start` resets it, so use such drafters one
    sequence at a time.
    """

    deterministic = False

    def __init__(
        self,
        model: PreTrainedModel,
        vocab_size: int | None = None,
        name: str = "draft",
        *,
        static_cache: bool = False,
        compile: bool | str = False,
    ):
        if static_cache or compile:
            self.adapter = static_adapter(model, 1, compile=compile, role="draft")  # sized in `reserve`
        else:
            self.adapter = CausalLMAdapter(model)
        self.vocab_size = vocab_size or self.adapter.vocab_size
        self.name = name
        self._kept = 0  # tokens of the context that are in the draft cache after `accepted`
        self._drafted_from = 0

    def reserve(self, max_context: int, num_tokens: int, sampling: SamplingConfig) -> float:
        if not hasattr(self.adapter, "warm_up"):
            return 0.0
        # The cache holds the context and up to num_tokens - 1 drafts; a call feeds <= 2 pending
        # tokens (the correction, or the last draft and the bonus) before drafting.
        self.adapter.reserve(max_context + num_tokens + 2)
        if sampling.greedy:  # the whole chain in one call
            limit = min(self.vocab_size, self.adapter.vocab_size)
            return sum(self.adapter.warm_up_greedy_chain(num_tokens, limit, num_new=p) for p in (1, 2))
        return self.adapter.warm_up([1]) + self.adapter.warm_up([2], last_only=True)  # step by step

    def start(self, prompt_ids: torch.Tensor) -> None:
        self.adapter.reset()

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        extra = self.vocab_size - logits.shape[-1]
        if extra > 0:
            return torch.nn.functional.pad(logits, (0, extra), value=float("-inf"))
        return logits[..., : self.vocab_size] if extra < 0 else logits

    def propose(self, context, num_tokens, sampling, generator=None) -> Proposal:
        device = self.adapter.device
        self._drafted_from = context.shape[0]
        # Catch up on the tokens the cache has not seen (the last correction/bonus token, and
        # after a full acceptance also the last draft token), then extend autoregressively.
        if self.adapter.seq_len >= context.shape[0]:  # nothing new: recompute the last logits
            self.adapter.crop(context.shape[0] - 1)
        pending = context[self.adapter.seq_len :].to(device).unsqueeze(0)
        if sampling.greedy and hasattr(self.adapter, "greedy_chain"):
            # The static adapter drafts the whole greedy chain in one (compiled) call.
            limit = min(self.vocab_size, self.adapter.vocab_size)  # argmax of the aligned logits
            tokens, raw = self.adapter.greedy_chain(pending, num_tokens, limit)
            return Proposal(tokens=tokens, logits=self._aligned(raw.float()))
        logits = self.adapter.forward(pending, logits_to_keep=1).logits[0, -1]
        tokens, probs, raw = [], [], []
        for i in range(num_tokens):
            logits = self._aligned(logits.float())
            raw.append(logits)
            if sampling.greedy:
                token = logits.argmax(-1, keepdim=True)
            else:
                q = sampling.probs(logits)
                probs.append(q)
                token = draw(q.to(generator.device if generator else q.device), generator)
                token = token.reshape(1).to(device)
            tokens.append(token)
            if i + 1 < num_tokens:
                logits = self.adapter.forward(token.view(1, 1)).logits[0, -1]
        return Proposal(
            tokens=torch.cat(tokens),
            probs=torch.stack(probs) if probs else None,
            logits=torch.stack(raw),
        )

    def accepted(self, num_accepted: int) -> None:
        # The cache holds context + x_1..x_{k-1}; keep the context and the accepted drafts.
        self.adapter.crop(min(self.adapter.seq_len, self._drafted_from + num_accepted))


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: find the latest earlier occurrence of the context's last n-gram
    (n from `max_ngram` down to `min_ngram`) and propose the tokens that followed it.

    Deterministic (q = 1 on each proposed token); costs no model call.
    """

    name = "prompt-lookup"
    deterministic = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return tuple(range(num_tokens + 1))  # whatever follows the match, or nothing

    def propose(self, context, num_tokens, sampling, generator=None) -> Proposal:
        seq = context.cpu()
        length = seq.shape[0]
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Windows starting at 0..length-n-1: every earlier n-gram except the suffix itself.
            windows = seq[:-1].unfold(0, n, 1)
            hits = (windows == seq[-n:]).all(-1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # the latest match is usually the most relevant
                follow = seq[start : start + num_tokens]
                if follow.numel():
                    return Proposal(tokens=follow.to(context.device))
        return Proposal(tokens=context.new_empty(0))


_MEDUSA_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # heads -> {mode: (Compiler, {key: fn})}


def _heads_function(heads: torch.nn.Module, num_heads: int, top: int):
    """h [H] -> (logits [num_heads, V] as float, then the argmax per head (top = 0: a chain) or
    the top-`top` token ids per head [num_heads, top] (a tree)): the first `num_heads` heads."""

    def run(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = heads(h[None], num_heads=num_heads)[:, 0].float()
        return logits, (logits.argmax(-1) if top == 0 else logits.topk(top, dim=-1).indices)

    return run


class MedusaDrafter(Drafter):
    """Medusa heads on the target's last hidden state (post-norm): head k applied to the state
    h of a token at position t predicts the token at t + 2 + k. The decoder hands over h of the
    last committed token; the bonus/correction token after it is what the target's own lm_head
    predicted from h, so head 0 proposes the first draft after it, head 1 the second, and so on.
    No model call beyond the heads, no cache.

    `heads`: any module with `heads.config.num_heads` and `heads(hidden [..., H], num_heads=n)
    -> logits [n, ..., V]` of the first n heads (`draftsmith.heads.medusa.MedusaHeads`); only
    the heads a proposal needs run (K = 3 of 4 heads skips the fourth projection).
    `tree=None`: a chain of the heads' argmax tokens. Otherwise a Medusa tree: a list of
    paths, each a tuple of ranks, (0, 2) = head 0's top-1 token, then head 1's third-best
    below it. Every prefix of every path is a node (build one with
    `draftsmith.eval.tree.build_medusa_tree`). Proposals are deterministic, so both are
    verified losslessly, unless `typical = (epsilon, delta)` asks for Medusa's lossy rule.
    `compile=True` (or a mode of `heads.static_target.COMPILE_MODES`) runs the heads and the
    argmax / top-k of every head as one compiled call (compiled in `reserve`). `static_cache`
    is taken for a uniform fast-path call and changes nothing: the heads keep no cache.
    """

    deterministic = True

    def __init__(
        self,
        heads: torch.nn.Module,
        target_num_layers: int,
        *,
        tree: list[tuple[int, ...]] | None = None,
        name: str = "medusa",
        typical: tuple[float, float] | None = None,
        static_cache: bool = False,
        compile: bool | str = False,
    ):
        self.heads = heads
        self.num_heads = int(heads.config.num_heads)
        param = next(itertools.chain(heads.parameters(), heads.buffers()), None)
        self._param = (param.device, param.dtype) if param is not None else None  # where h goes
        self._compile = compile
        self._compiled = None  # (heads run, compiled function), set by `reserve`
        self.target_layers = (int(target_num_layers),)
        self.name = name
        self.typical = tuple(typical) if typical is not None else None
        self._h: torch.Tensor | None = None
        self.tree = None if tree is None else [tuple(int(r) for r in path) for path in tree]
        if self.tree is not None:
            self._build_tree(self.tree)

    def _build_tree(self, tree: list[tuple[int, ...]]) -> None:
        if not tree:
            raise ValueError("the Medusa tree is empty: give at least one path, or tree=None for a chain")
        for path in tree:
            if not path:
                raise ValueError("a Medusa tree path must hold at least one rank")
            if len(path) > self.num_heads:
                raise ValueError(
                    f"tree deeper than the number of heads: path {path} has depth {len(path)}, "
                    f"the heads predict {self.num_heads} tokens"
                )
            if any(r < 0 for r in path):
                raise ValueError(f"tree ranks must be >= 0, got path {path}")
        # Nodes: every prefix of every path, once, ordered by depth then by first appearance.
        order: dict[tuple[int, ...], int] = {}
        for path in tree:
            for d in range(1, len(path) + 1):
                order.setdefault(path[:d], len(order))
        nodes = sorted(order, key=lambda node: (len(node), order[node]))
        index = {node: i for i, node in enumerate(nodes)}
        self._parents = [index[node[:-1]] if len(node) > 1 else -1 for node in nodes]
        self._depth = torch.tensor([len(node) - 1 for node in nodes])  # head of each node
        self._rank = torch.tensor([node[-1] for node in nodes])
        self._top = int(self._rank.max()) + 1  # top-k width needed from every head
        # Nodes of depth <= d form a prefix of the list: the tree truncated to d tokens.
        self._count = [sum(len(node) <= d for node in nodes) for d in range(self.num_heads + 1)]

    @property
    def max_depth(self) -> int:
        """K for this drafter: the tree's depth (or the number of heads for a chain)."""
        return self.num_heads if self.tree is None else int(self._depth.max()) + 1

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        depth = min(num_tokens, self.num_heads)
        return (depth if self.tree is None else self._count[depth],)

    def _heads_used(self, num_tokens: int) -> int:
        """How many heads a proposal of `num_tokens` reads: the chain's length, the tree's depth."""
        depth = min(num_tokens, self.num_heads)
        return depth if self.tree is None else int(self._depth[: self._count[depth]].max()) + 1

    def reserve(self, max_context: int, num_tokens: int, sampling: SamplingConfig) -> float:
        used = self._heads_used(num_tokens)
        if not self._compile or (self._compiled and self._compiled[0] >= used):
            return 0.0
        # Compiled once per heads module, mode and shape, shared by every drafter over them.
        device, dtype = self._param or (torch.device("cpu"), torch.float32)
        mode = compile_mode(self._compile)
        slots = _MEDUSA_COMPILED.setdefault(self.heads, {})
        if mode not in slots:
            slots[mode] = (Compiler(mode, device, f"the Medusa heads ({type(self.heads).__name__})"), {})
        compiler, functions = slots[mode]
        key = (used, self._top if self.tree is not None else 0)
        before = compiler.seconds
        if key not in functions and compiler.enabled:
            h = torch.zeros(self.heads.config.hidden_size, device=device, dtype=dtype)
            compiled = compiler.wrap(_heads_function(self.heads, *key))
            with torch.inference_mode():
                if compiler.first_calls("the Medusa heads", compiled, h):
                    functions[key] = compiled
        if key in functions:
            self._compiled = (used, functions[key])  # a shorter proposal reads its first heads
        return compiler.seconds - before

    def start(self, prompt_ids: torch.Tensor) -> None:
        self._h = None

    def observe(self, hidden: dict[int, torch.Tensor]) -> None:
        states = hidden[self.target_layers[0]]
        if states.shape[0]:
            self._h = states[-1]

    @torch.inference_mode()
    def propose(self, context, num_tokens, sampling, generator=None) -> Proposal:
        if self._h is None or num_tokens < 1:  # a one-token prompt: nothing observed yet
            return Proposal(tokens=context.new_empty(0))
        h = self._h if self._param is None else self._h.to(device=self._param[0], dtype=self._param[1])
        used = self._heads_used(num_tokens)
        if self._compiled is not None and self._compiled[0] >= used:
            logits, top = self._compiled[1](h)
            if h.device.type == "cuda":  # CUDA graph outputs are reused by the next replay
                logits, top = logits.clone(), top.clone()
        else:
            logits, top = _heads_function(self.heads, used, self._top if self.tree is not None else 0)(h)
        if self.tree is None:
            depth = min(num_tokens, self.num_heads)
            return Proposal(tokens=top[:depth].to(context.device), logits=logits[:depth])
        count = self._count[min(num_tokens, self.num_heads)]
        depth, rank = self._depth[:count], self._rank[:count]
        tokens = top[depth.to(top.device), rank.to(top.device)]
        return Proposal(tokens=tokens.to(context.device), parents=self._parents[:count])
