"""The speculative decoder: ONE loop over B rows; batch-1 decoding is a batch of one.

Every call: the drafter proposes, per row, a chain or a tree of up to K tokens (K = depth for a
tree); the target scores every row's [last, proposal] in ONE forward (a tree with its ancestor
mask and depth positions); each row keeps the prefix/path its own rule accepts plus one token
(the correction at the first rejection, or the bonus); the KV cache keeps, per row, `last` and
that path (`decoding/kv.py`). With no drafter (or K = 0) the same loop is plain
autoregressive decoding: the speedup baseline runs the very same code. The target's cache holds
every token but the last, so the first call already speculates.

Verification per row, with the row's own generator:
- greedy: the longest matching prefix/path of the target's argmax, then the argmax;
- lossless sampling (`sampling.verify_chain`, `tree.verify_tree`): the emitted tokens are
  distributed exactly as the target's own sampling;
- typical acceptance (`typical=(epsilon, delta)`, `tree.verify_tree_typical`): LOSSY at T > 0,
  and said so (`stats.lossy`); at T = 0 it is exact argmax matching, so greedy stays lossless.
Randomness: row b draws from a generator seeded with `seeds[b]` and makes the same calls in the
same order whatever the other rows do, so `generate_batch(seed=s)` row b equals
`generate(seed=row_seed(s, b))` (up to the float round-off of batched forwards).

The static path (`static_cache=True`, or `compile=`): every model's KV store is sized up front
for the whole request (the default path's stores grow as they fill) and, with
`compile`, the target's verification widths (1 + each usual proposal size) and the draft's steps
are compiled before the clock starts (`compile_seconds`, never part of the decoding time).
"""

from __future__ import annotations

import time

import torch
from transformers import PreTrainedModel

from draftsmith.decoding.compiler import compile_mode
from draftsmith.decoding.drafters import Drafter, Proposal
from draftsmith.decoding.kv import capacity_for, model_cache
from draftsmith.decoding.linears import cpu_linears
from draftsmith.decoding.masks import chain_attend, tree_attend
from draftsmith.decoding.recurrent import state_layers
from draftsmith.decoding.sampling import (
    SamplingConfig,
    acceptance_probability,
    kl_divergence,
    split_kl,
    total_variation,
    verify_chain,
    verify_chain_greedy,
)
from draftsmith.decoding.stats import BatchResult, DecodeStats, Generation
from draftsmith.decoding.target import check_prompts, max_positions, right_aligned, synchronize
from draftsmith.decoding.tree import depths, truncate_tree, verify_tree, verify_tree_greedy, verify_tree_typical

_MAX_SEED = 2**32  # seeds of generate_batch: [0, 2**32)
DEFAULT_NUM_DRAFT_TOKENS = 4  # K when a caller names none (the evaluator's settings take it too)
_MASK64 = 2**64 - 1


def row_seed(seed: int, row: int) -> int:
    """Seed of row `row`'s generator in `generate_batch(seed=seed)`, and what batch-1
    `generate(seed=...)` takes to draw the same as that row. torch's CPU generator keeps only
    the low 32 bits of a seed, so (seed, row) is hashed (splitmix64) into 32 bits: rows of one
    batch and batches of nearby seeds get unrelated streams (a collision has odds ~2**-32)."""
    x = (seed * _MAX_SEED + row + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 32


def eos_set(eos_token_id) -> set[int]:
    """The stop ids as a set: None, one id, or a list / tensor of ids."""
    if eos_token_id is None:
        return set()
    return {int(t) for t in torch.as_tensor(eos_token_id).flatten().tolist()}


def generate(
    target: PreTrainedModel,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id=None,
    measure_distances: bool = False,
    typical: tuple[float, float] | None = None,
    static_cache: bool = False,
    compile: bool | str = False,
) -> Generation:
    """Decode one prompt (1-D or [1, T]) with `drafter` (None = target only): `decode` with B = 1.
    `seed=None` seeds from the system's entropy."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise ValueError(f"input_ids must be a LongTensor, got {getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if input_ids.dim() == 2 and input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be 1-D or [1, T]; got batch {input_ids.shape[0]} (use generate_batch)")
    if input_ids.dim() not in (1, 2) or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D (or [1, T]) tensor, got shape {list(input_ids.shape)}")
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    result = decode(
        target,
        [input_ids],
        drafter,
        num_draft_tokens=num_draft_tokens,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        eos_token_id=eos_token_id,
        seeds=[seed],
        static_cache=static_cache,
        compile=compile,
        measure_distances=measure_distances,
        typical=typical,
    )
    stats = result.rows[0]
    stats.compile_seconds = result.compile_seconds
    return Generation(tokens=result.tokens[0], stats=stats)


def generate_batch(
    target: PreTrainedModel, prompts: list[torch.Tensor], drafter: Drafter | None = None, *, seed: int = 0, **options
) -> BatchResult:
    """Decode every prompt in one batch, row b with the generator of `row_seed(seed, b)`: `decode`
    with one seed for the batch; every other keyword (`max_new_tokens`, `sampling`, ...) is `decode`'s."""
    if not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
        raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
    seeds = [row_seed(seed, b) for b in range(len(prompts) if isinstance(prompts, (list, tuple)) else 0)]
    return decode(target, prompts, drafter, seeds=seeds, **options)


def _typical(drafter, typical, sampling: SamplingConfig):
    """The typical-acceptance setting in force: None when lossless (no drafter, or greedy)."""
    typical = getattr(drafter, "typical", None) if typical is None and drafter is not None else typical
    if typical is None or drafter is None:
        return None
    if len(typical) != 2 or not all(float(v) >= 0 for v in typical):
        raise ValueError(f"typical must be (epsilon, delta) with both >= 0, got {typical!r}")
    # As T -> 0 the target distribution is one-hot and the rule is exact argmax matching.
    return None if sampling.greedy else (float(typical[0]), float(typical[1]))


def _generator(device: torch.device, seed: int | None) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@torch.inference_mode()
def decode(
    target: PreTrainedModel,
    prompts: list[torch.Tensor],
    drafter: Drafter | None = None,
    *,
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    eos_token_id=None,
    seeds: list[int | None],
    static_cache: bool = False,
    compile: bool | str = False,
    measure_distances: bool = False,
    typical: tuple[float, float] | None = None,
) -> BatchResult:
    """Decode every prompt up to `max_new_tokens` (or its first eos), all rows in one batch.

    Lossless per row (greedy equals the target's greedy decoding; sampling is distributed as the
    target's sampling under `sampling`), except under `typical` at T > 0. `measure_distances`
    adds per-position expected acceptance (and KL/TV where the drafter gives logits) to the
    stats; off for timing runs. `static_cache` / `compile`: see the module docstring.
    """
    prompts = check_prompts(prompts)
    if not isinstance(num_draft_tokens, int) or num_draft_tokens < 0:
        raise ValueError(f"num_draft_tokens (K) must be an integer >= 0 (0 = target only), got {num_draft_tokens!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = SamplingConfig() if sampling is None else sampling
    if not isinstance(sampling, SamplingConfig):
        raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    if not isinstance(target, PreTrainedModel):
        raise TypeError(f"target must be a transformers PreTrainedModel, got {type(target).__name__}")
    if drafter is not None and not isinstance(drafter, Drafter):
        raise TypeError(f"drafter must be a draftsmith Drafter (decoding.drafters), got {type(drafter).__name__}")
    if len(seeds) != len(prompts):
        raise ValueError(f"{len(seeds)} seeds for {len(prompts)} prompts")
    model = target.eval()
    k_max = num_draft_tokens if drafter is not None else 0
    drafter = drafter if k_max else None
    if drafter is not None and drafter.trees and state_layers(model.config, "the target"):
        raise ValueError(
            f"drafter {drafter.name!r} proposes trees, but the target has recurrent layers (linear attention, "
            "convolutions or SSMs): a tree's branches would each need their own state; decode it as a chain"
        )
    typical = _typical(drafter, typical, sampling)
    _check_lengths(model, drafter, prompts, max_new_tokens)
    layers = drafter.target_layers if drafter is not None else ()
    num_layers = model.config.get_text_config().num_hidden_layers
    if any(not 0 <= i <= num_layers for i in layers):
        raise ValueError(f"drafter {drafter.name!r} reads target layers {layers}; the target has 0..{num_layers}")

    with cpu_linears(model, *(drafter.modules() if drafter is not None else ())):
        device, batch = model.device, len(prompts)
        eos = eos_set(eos_token_id)
        generators = [_generator(device, s) for s in seeds]
        contexts = [p.tolist() for p in prompts]  # prompt + emitted, per row, on the host
        new: list[list[int]] = [[] for _ in range(batch)]
        stats = [DecodeStats(num_draft_tokens=k_max, lossy=typical is not None) for _ in range(batch)]
        result = BatchResult(tokens=new, rows=stats, stopped=["length"] * batch)
        vocab = model.get_output_embeddings().weight.shape[0]

        def now() -> float:
            synchronize(device)
            return time.perf_counter()

        # Outside the clock: size the static caches for this request, compile what the loop runs.
        capacity = None
        widths = sorted({1 + int(size) for size in (drafter.proposal_sizes(k_max) if drafter else (0,))})
        if static_cache or compile_mode(compile) is not None:
            capacity = capacity_for(max(map(len, contexts)) + max_new_tokens + widths[-1])
            kv = model_cache(model, "target", batch, capacity, compile)
            result.compile_seconds = kv.warm_up(widths, hidden_layers=layers)
        if drafter is not None:
            result.compile_seconds += drafter.prepare(
                batch, capacity, compile, k_max, sampling, logits=measure_distances
            )
        start = now()
        if capacity is None:
            kv = model_cache(model, "target", batch, None)
        prefill = {}
        if max(map(len, contexts)) > 1:  # every prompt token but the last (the first call feeds it)
            ids, positions, lo = right_aligned([c[:-1] for c in contexts], [0] * batch, device)
            kv.reserve(ids.shape[1])
            attend = chain_attend(ids.shape[1], lo, None, batch, device) if any(lo) else None
            prefill = kv.forward(model, ids, positions, attend, hidden_layers=layers, logits_to_keep=1).hidden_states
            kv.commit_spans(ids.shape[1], lo)
        if drafter is not None:
            drafter.start(contexts, prefill, vocab)
        result.prefill_seconds = now() - start
        for row in stats:
            row.prefill_seconds = result.prefill_seconds

        active = list(range(batch))  # original index of each row still decoding
        while active:
            size = len(active)
            budget = [min(k_max, max_new_tokens - len(new[r]) - 1) for r in active]  # never draft past the budget
            t0 = now()
            proposal = None
            if drafter is not None and max(budget) > 0:
                proposal = drafter.propose(
                    [contexts[r] for r in active], budget, sampling, [generators[r] for r in active]
                )
            t1 = now()
            call = _Call(proposal, budget, typical is not None, size, device)
            # Fed per row: `last` (its last token, not yet fed) at the count of real tokens before it,
            # then the proposal at its depths after it (one host->device copy of ids and positions,
            # each [B, W + 1] in standard strides).
            host = [
                [[contexts[r][-1]] * (call.width + 1) for r in active],
                [[len(contexts[r]) - 1 + d for d in call.depths[i]] for i, r in enumerate(active)],
            ]
            fed, positions = torch.tensor(host, device=device).view(2, size, call.width + 1)
            if call.width:
                fed = torch.cat([fed[:, :1], call.tokens], dim=1)
            kv.reserve(max(widths[-1], fed.shape[1]))  # the widest call (compiled calls are padded to it)
            out = kv.forward(model, fed, positions, call.attend, hidden_layers=layers)
            paths, emitted, lossy_kl = _verify(out.logits, call, sampling, typical, [generators[r] for r in active])
            call.commit(kv, paths)  # row b keeps `last` and its accepted path
            if measure_distances:
                for i, r in enumerate(active):
                    _add_distances(stats[r], out.logits[i], call, i, paths[i], sampling, typical)
            # Cut each row's output at its first eos; finished rows leave the batch.
            hits = [next((j for j, t in enumerate(tokens) if t in eos), None) for tokens in emitted]
            for r, tokens, hit in zip(active, emitted, hits):
                new[r].extend(tokens if hit is None else tokens[: hit + 1])
                contexts[r].extend(tokens)
            alive = [i for i, (r, hit) in enumerate(zip(active, hits)) if hit is None and len(new[r]) < max_new_tokens]
            index = torch.tensor(alive, dtype=torch.long, device=device) if alive and len(alive) < size else None
            if index is not None:
                kv.select(index, alive)  # with compiled steps they stay, as padding rows
            kv.compact_if_wasteful()
            t2 = now()
            for i, r in enumerate(active):
                row, n = stats[r], len(paths[i])
                row.proposed.append(call.counts[i])
                row.accepted.append(n)
                # Depth j + 1 was reached when the path got to depth j and the node there has children.
                for j in range(n + call.has_children(i, paths[i])):
                    row.reached[j] += 1
                    row.accepted_at[j] += int(j < n)
                row.lossy_kl_sum += lossy_kl[i]
                row.target_seconds += t2 - t1
                row.ttft_seconds = row.ttft_seconds or t2 - start
                if i not in alive:
                    result.stopped[r] = "eos" if hits[i] is not None else "length"
                    row.new_tokens, row.total_seconds = len(new[r]), t2 - start
            if alive and drafter is not None:
                if index is not None:
                    drafter.select(index, alive)
                committed, hidden = call.committed(emitted, paths, out.hidden_states, alive)
                drafter.accepted([len(paths[i]) for i in alive], committed, hidden)
            t3 = now()
            result.call_seconds.append(t2 - t1)
            result.call_rows.append(size)
            result.drafter_seconds.append((t1 - t0) + (t3 - t2) if drafter is not None else 0.0)
            for r in active:
                stats[r].drafter_seconds += result.drafter_seconds[-1]
            active = [active[i] for i in alive]
        result.total_seconds = now() - start
        return result


def _check_lengths(model, drafter, prompts, max_new_tokens: int) -> None:
    limits = [("target", max_positions(model.config))]
    if drafter is not None:
        limits.append((f"drafter {drafter.name!r}", drafter.max_positions()))
    for b, prompt in enumerate(prompts):
        for what, limit in limits:
            if limit is not None and prompt.numel() + max_new_tokens > limit:
                raise ValueError(
                    f"prompts[{b}] has {prompt.numel()} tokens; with max_new_tokens={max_new_tokens} the row reaches "
                    f"{prompt.numel() + max_new_tokens} positions, more than the {what}'s "
                    f"max_position_embeddings={limit}"
                )


class _Call:
    """One call's proposal laid out for the target: per row its node count, parents (a chain:
    each node's parent is the node before it), fed offsets (the depth), attention and depth."""

    def __init__(self, proposal: Proposal | None, budget: list[int], typical: bool, rows: int, device):
        self.proposal = proposal
        if proposal is not None and proposal.parents is not None and proposal.probs is not None:
            raise ValueError(
                "a tree proposal must be deterministic (probs=None): its nodes are verified with q one-hot, "
                "so a sampled tree would not be lossless"
            )
        self.device = device
        if proposal is None:
            self.counts = [0] * rows
            self.tokens = None  # nothing fed after `last`
        else:
            self.counts = [min(c, k) if proposal.parents is None else c for c, k in zip(proposal.counts, budget)]
            self.tokens = proposal.tokens.to(device)
        self.parents = [list(range(-1, c - 1)) for c in self.counts]
        # A row verified node by node: a tree, or a chain under typical acceptance.
        trees = proposal is not None and proposal.parents is not None
        self.tree = [bool(c) and (typical or trees) for c in self.counts]
        if proposal is not None and proposal.parents is not None:
            self._trees(proposal, budget, device)
        self.width = width = max(self.counts, default=0)
        if self.tokens is not None and self.tokens.shape[1] != width:
            self.tokens = self.tokens[:, :width]
        self.attend, self.depths = None, [range(width + 1)] * rows  # per row, each fed column's depth
        if proposal is not None and proposal.parents is not None:
            self.attend, fed_depths = tree_attend(self.parents, width + 1, device)
            self.depths = [d + [0] * (width + 1 - len(d)) for d in fed_depths]

    def _trees(self, proposal: Proposal, budget: list[int], device) -> None:
        """Every row's tree, cut to the row's depth budget (the call emits at most depth + 1)."""
        rows = []
        for b, (parents, count, k) in enumerate(zip(proposal.parents, self.counts, budget)):
            parents = [int(q) for q in parents[:count]]
            if parents and max(depths(parents)) > k:
                keep = truncate_tree(parents, k)
                where = {old: new for new, old in enumerate(keep)}
                parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in keep]
                row = proposal.tokens[b, torch.tensor(keep, device=proposal.tokens.device)]
                rows.append(torch.nn.functional.pad(row, (0, proposal.tokens.shape[1] - len(keep))))
            else:
                rows.append(proposal.tokens[b])
            self.parents[b], self.counts[b] = parents, len(parents)
        self.tokens = torch.stack(rows).to(device)

    def has_children(self, b: int, path: list[int]) -> bool:
        """Whether the node a row's accepted path ends at (the root when empty) has children."""
        end = path[-1] if path else -1
        return any(parent == end for parent in self.parents[b])

    def commit(self, kv, paths: list[list[int]]) -> None:
        """Row b of `kv` keeps column 0 (`last`) and the columns of its accepted path."""
        if not any(self.tree):  # chains: a path is the first n nodes, so the first n + 1 columns
            return kv.commit_spans(self.width + 1, None, [len(path) + 1 for path in paths])
        keep = torch.zeros(len(paths), self.width + 1, dtype=torch.bool)  # on the host: the cache reads it there
        for b, path in enumerate(paths):
            keep[b, [0] + [i + 1 for i in path]] = True
        kv.commit(keep)

    def committed(self, emitted, paths, hidden, alive):
        """Of the rows `alive`: the tokens each emitted [R, W] (left-aligned, 0-padded), and the
        target states of its committed fed columns (`last` and the path) in its first columns."""
        width = max(len(emitted[i]) for i in alive)
        device = self.device
        committed = torch.tensor([emitted[i] + [0] * (width - len(emitted[i])) for i in alive], device=device)
        index = torch.tensor(alive, device=device) if any(self.tree) or len(alive) < len(paths) else None
        if any(self.tree):  # gather `last` and the path's columns to the front
            cols = [[0] + [j + 1 for j in paths[i]] for i in alive]
            cols = torch.tensor([c + [0] * (width - len(c)) for c in cols], device=device)
            hidden = {
                k: h.index_select(0, index.to(h.device)).gather(
                    1, cols.to(h.device)[..., None].expand(-1, -1, h.shape[-1])
                )
                for k, h in hidden.items()
            }
        elif len(alive) < len(paths):
            hidden = {k: h.index_select(0, index.to(h.device)) for k, h in hidden.items()}
        return committed.view(len(alive), width), hidden


def _verify(logits, call: _Call, sampling: SamplingConfig, typical, generators):
    """Per row: the accepted path (node indices, root to leaf; a chain's is its first n nodes),
    the tokens it emits (the path's tokens, then the correction or bonus) and the typical rule's
    KL estimate. One device->host copy for a greedy batch."""
    paths, emitted, kl = [], [], [0.0] * len(call.counts)
    if sampling.greedy:
        # Chains: keep the drafts equal to the target's argmax before them, then emit the argmax
        # (a row's padding past its own count never counts). Trees walk the argmax down.
        argmax = logits.argmax(-1)  # [R, W]: no float copy needed, a cast keeps the order
        ids = (torch.cat([argmax, call.tokens], dim=1) if call.width else argmax).tolist()  # one copy to the host
        for b, row in enumerate(ids):
            argmax_b, tokens, k = row[: call.width + 1], row[call.width + 1 :], call.counts[b]
            if call.tree[b]:
                path, nxt = verify_tree_greedy(argmax_b[: k + 1], call.parents[b], tokens[:k])
            else:
                n, nxt = verify_chain_greedy(argmax_b[: k + 1], tokens[:k])
                path = list(range(n))
            paths.append(path)
            emitted.append([tokens[i] for i in path] + [nxt])
        return paths, emitted, kl
    p = sampling.probs(logits.float())  # [R, W, V]
    probs = call.proposal.probs if call.proposal is not None else None
    for b, g in enumerate(generators):
        k = call.counts[b]
        tokens = call.tokens[b, :k] if k else torch.zeros(0, dtype=torch.long, device=p.device)
        if not call.tree[b]:
            # Speculative sampling: accept x_i with prob min(1, p_i(x_i) / q_i(x_i)); at the
            # first rejection sample from norm(max(0, p_i - q_i)); after K acceptances sample
            # the bonus from p_K. q = None (deterministic drafts): q one-hot on x_i. Every
            # emitted token ~ p.
            q = probs[b : b + 1, :k].to(p.device) if probs is not None and k else None
            n, nxt = verify_chain(p[b : b + 1, : k + 1], tokens[None], q, g)
            path, nxt = list(range(int(n))), int(nxt)
        elif typical is None:  # recursive rejection over the siblings at each depth (lossless)
            path, nxt = verify_tree(p[b, : k + 1], call.parents[b], tokens.tolist(), g)
        else:  # typical acceptance: LOSSY at T > 0
            path, nxt, kl[b] = verify_tree_typical(
                logits[b, : k + 1], p[b, : k + 1], call.parents[b], tokens.tolist(), sampling.temperature, *typical, g
            )
        paths.append(path)
        emitted.append([int(tokens[i]) for i in path] + [int(nxt)])
    return paths, emitted, kl


def _add_distances(stats: DecodeStats, logits, call: _Call, b: int, path, sampling, typical) -> None:
    """Per-position distances on the positions whose context is the true trajectory. A tree:
    the expected acceptance at depth 1 only (the target mass of the root's candidates, or the
    argmax test at T = 0); none under typical acceptance."""
    k = call.counts[b]
    if not k or typical is not None:
        return
    proposal, tokens = call.proposal, call.tokens[b, :k]
    logits = logits.float()
    if call.tree[b]:
        roots = sorted({int(tokens[i]) for i, q in enumerate(call.parents[b]) if q < 0})
        root = logits[0].argmax() if sampling.greedy else None
        expected = float(int(root) in roots) if root is not None else float(sampling.probs(logits[0])[roots].sum())
        stats.accept_prob_sum[0] += expected
        stats.distance_count[0] += 1
        return
    reached = min(len(path) + 1, k)
    tokens = tokens[:reached]
    if sampling.greedy:
        expected = (logits[:reached].argmax(-1) == tokens).float()
    else:
        p = sampling.probs(logits[:reached])
        if proposal.probs is None:  # deterministic: accepted with probability p(x)
            expected = p.gather(-1, tokens[:, None]).squeeze(-1)
        else:
            expected = acceptance_probability(p, proposal.probs[b, :reached].to(p.device))
    kl = tv = None
    if proposal.logits is not None:
        p_raw = torch.softmax(logits[:reached], -1)
        q_logits = proposal.logits[b, :reached].to(logits.device).float()
        q_raw = torch.softmax(q_logits, -1)
        kl, tv = kl_divergence(p_raw, q_raw).tolist(), total_variation(p_raw, q_raw).tolist()
        oov, kl_vocab = (x.tolist() for x in split_kl(p_raw, q_logits))
    for i, e in enumerate(expected.tolist()):
        stats.accept_prob_sum[i] += e
        stats.distance_count[i] += 1
        if kl is not None:
            stats.kl_sum[i] += kl[i]
            stats.tv_sum[i] += tv[i]
            stats.oov_sum[i] += oov[i]
            stats.kl_vocab_sum[i] += kl_vocab[i]
            stats.kl_count[i] += 1
