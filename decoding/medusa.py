"""Medusa heads as a drafter: every head reads the target's last hidden state, one forward drafts
a chain (each head's argmax) or a tree (each head's top-k, paths of ranks), verified like any
proposal (decoding/drafters.py holds the contract)."""

from __future__ import annotations

import itertools
import weakref

import torch

from draftsmith.decoding.compiler import Compiler, compile_mode
from draftsmith.decoding.drafters import Drafter, Proposal

_MEDUSA_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # heads -> {mode: (Compiler, {key: fn})}


def _heads_function(heads: torch.nn.Module, num_heads: int, top: int):
    """h [B, H] -> (logits [num_heads, B, V] as float, then the argmax per head (top = 0: a
    chain) or the top-`top` ids per head [num_heads, B, top] (a tree)): the first heads only."""

    def run(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = heads(h, num_heads=num_heads).float()
        return logits, (logits.argmax(-1) if top == 0 else logits.topk(top, dim=-1).indices)

    return run


class MedusaDrafter(Drafter):
    """Medusa heads on the target's last hidden state (post-norm): head j applied to the state h
    of a token at position t predicts the token at t + 2 + j. The state of each row's last
    committed token comes from the verification forward that committed it (no extra pass); the
    correction/bonus after it is what the target's own lm_head predicted, so head 0 proposes
    the first draft after it. A row whose prompt is one token has no state before its first call
    and proposes nothing.

    `heads(hidden [..., H], num_heads=n) -> logits [n, ..., V]` of the first n heads
    (`draftsmith.heads.medusa.MedusaHeads`); only the heads a proposal reads run. `tree=None`: a
    chain of the heads' argmax tokens. Otherwise a Medusa tree: paths of ranks, (0, 2) = head 0's
    top-1 token, then head 1's third-best below it; every prefix of every path is a node (build
    one with `eval.medusa_tree.build_medusa_tree`). Proposals are deterministic, so both are
    verified losslessly, unless `typical = (epsilon, delta)` asks for Medusa's lossy rule. With
    `compile` the heads and their argmax / top-k run as one compiled call (full batches).
    """

    cost_per_step = True  # every head in one forward

    def __init__(
        self,
        heads: torch.nn.Module,
        target_num_layers: int | None = None,
        *,
        tree=None,
        name: str = "medusa",
        typical: tuple[float, float] | None = None,
    ):
        self.heads = heads
        self.num_heads = int(heads.config.num_heads)
        if target_num_layers is None:  # recorded by MedusaHeads.for_target
            target_num_layers = getattr(heads.config, "target_num_layers", None)
        if target_num_layers is None:
            raise ValueError(
                "MedusaDrafter needs the target's number of layers (the heads read its last, post-norm hidden "
                "state): pass target_num_layers, the heads' config does not record it"
            )
        param = next(itertools.chain(heads.parameters(), heads.buffers()), None)
        self._param = (param.device, param.dtype) if param is not None else (torch.device("cpu"), torch.float32)
        self.target_layers = (int(target_num_layers),)
        self.name = name
        self.typical = tuple(typical) if typical is not None else None
        self._compiled = None  # (rows, heads used, compiled function), set by `prepare`
        self._h: torch.Tensor | None = None  # [B, H] state of each row's last committed token
        self._has: list[bool] = []
        self.tree = None if tree is None else [tuple(int(r) for r in path) for path in tree]
        self._top = 0
        if self.tree is not None:
            self._build_tree(self.tree)
        self.max_depth = self.num_heads if self.tree is None else int(self._depth.max()) + 1
        self.trees = self.tree is not None

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

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        depth = min(num_tokens, self.num_heads)
        return (depth if self.tree is None else self._count[depth],)

    def _heads_used(self, num_tokens: int) -> int:
        """How many heads a proposal of `num_tokens` reads: the chain's length, the tree's depth."""
        depth = min(num_tokens, self.num_heads)
        return depth if self.tree is None else int(self._depth[: self._count[depth]].max()) + 1

    def prepare(self, batch, capacity, compile, num_tokens, sampling, logits=False) -> float:
        used, self.logits = self._heads_used(num_tokens), logits
        if compile_mode(compile) is None:
            self._compiled = None
            return 0.0
        # Compiled once per heads module, mode and shape, shared by every drafter over them.
        slots = _MEDUSA_COMPILED.setdefault(self.heads, {})
        mode = compile_mode(compile)
        if mode not in slots:
            slots[mode] = (Compiler(mode, self._param[0], f"the Medusa heads ({type(self.heads).__name__})"), {})
        compiler, functions = slots[mode]
        key = (batch, used, self._top)
        before = compiler.seconds
        if key not in functions and compiler.enabled:
            h = torch.zeros(batch, self.heads.config.hidden_size, device=self._param[0], dtype=self._param[1])
            compiled = compiler.wrap(_heads_function(self.heads, used, self._top))
            with torch.inference_mode():
                if compiler.first_calls("the Medusa heads", compiled, h):
                    functions[key] = compiled
        self._compiled = (batch, used, functions[key]) if key in functions else None
        return compiler.seconds - before

    def start(self, prompts, prefill, vocab_size) -> None:
        self._has = [len(p) >= 2 for p in prompts]
        states = prefill.get(self.target_layers[0])
        # right-aligned: column -1 is real. A copy in standard strides: the view's follow the prompt's
        # length (even with one row, where `.contiguous()` keeps them), and compiled heads would
        # recompile for every new stride (`accepted`'s states are gathered, so already standard).
        self._h = states[:, -1].clone(memory_format=torch.contiguous_format) if states is not None else None

    @torch.inference_mode()
    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        depth = [min(k, self.num_heads) if has else 0 for k, has in zip(num_tokens, self._has)]
        if max(depth) == 0:  # also when no row has a state yet (every prompt one token long)
            return Proposal.empty(len(depth))
        h = self._h.to(device=self._param[0], dtype=self._param[1])
        used = self._heads_used(max(depth))
        if self._compiled is not None and self._compiled[0] == h.shape[0] and self._compiled[1] >= used:
            logits, top = self._compiled[2](h)
            if h.device.type == "cuda":  # CUDA graph outputs are reused by the next replay
                logits, top = logits.clone(), top.clone()
        else:
            logits, top = _heads_function(self.heads, used, self._top)(h)
        if self.tree is None:  # head j's argmax proposes draft j + 1
            width = max(depth)
            raw = logits[:width].transpose(0, 1) if self.logits else None
            return Proposal(tokens=top[:width].T, counts=depth, logits=raw)
        counts = [self._count[d] for d in depth]
        nodes = max(counts)
        head, rank = self._depth[:nodes].to(top.device), self._rank[:nodes].to(top.device)
        tokens = top[head, :, rank].T  # [B, nodes]: node i is rank_i of head_i
        return Proposal(tokens=tokens, counts=counts, parents=[self._parents[:c] for c in counts])

    def select(self, rows, kept) -> None:
        self._h = self._h.index_select(0, rows.to(self._h.device)) if self._h is not None else None
        self._has = [self._has[i] for i in kept]

    def accepted(self, num_accepted, committed, hidden) -> None:
        states = hidden[self.target_layers[0]]  # row b's committed columns first
        rows = torch.arange(states.shape[0], device=states.device)
        self._h = states[rows, torch.tensor(num_accepted, device=states.device)]
        self._has = [True] * states.shape[0]


def medusa_rows(heads, target, name: str, options=None) -> dict:
    """The registry's rows of Medusa heads: NAME-chain, and NAME-tree when `options.tree` is "auto"
    (built from the heads' recorded accuracies, `options.tree_nodes` nodes) or JSON paths."""
    layers = target.config.get_text_config().num_hidden_layers
    typical = options.typical if options is not None else None
    rows = {f"{name}-chain": MedusaDrafter(heads, layers, name=f"{name}-chain", typical=typical)}
    if options is not None and options.tree:
        tree = parse_medusa_tree(options.tree, heads, options.tree_nodes)
        rows[f"{name}-tree"] = MedusaDrafter(heads, layers, tree=tree, name=f"{name}-tree", typical=typical)
    return rows


def parse_medusa_tree(text: str, heads, num_nodes: int) -> list[tuple[int, ...]]:
    """ "auto" (a tree of `num_nodes` from the heads' recorded accuracies) or JSON paths; ValueError
    naming what was expected."""
    import json

    from draftsmith.decoding.medusa_tree import build_medusa_tree

    if text == "auto":
        accuracies = heads.config.head_accuracies
        if not accuracies:
            raise ValueError(
                "tree auto: the heads record no accuracies (train them with `draftsmith train medusa`, "
                "or give the paths as JSON)"
            )
        return build_medusa_tree(accuracies, num_nodes)
    try:
        return [tuple(int(r) for r in path) for path in json.loads(text)]
    except (ValueError, TypeError) as err:
        raise ValueError(f"tree {text!r}: expected auto or a JSON list of paths like [[0],[1],[0,0]] ({err})") from None
