"""The speculative decoder: one loop for target-only and speculative decoding.

Each iteration: the drafter proposes k tokens, the target scores [last token, x_1..x_k] in
one forward, `verify_chain` keeps a prefix and adds one token (the correction at the first
rejection, or the bonus after a full acceptance), the caches are cropped. With no drafter
k = 0, and the same loop is plain autoregressive decoding: the speedup baseline runs the very
same code.

The target's cache always holds every token but the last; the first iteration therefore
already speculates (the prompt's last token is fed together with the first drafts).

Tree proposals (Medusa, EAGLE) take the same loop: [last] + the tree's nodes go in one forward
with a 4-D tree mask and explicit positions, `eval/tree.py` picks the accepted path (greedy,
or lossless recursive rejection), and the cache keeps `last` + that path. With a drafter's
`typical` set, Medusa's typical acceptance replaces the lossless rule: LOSSY, and the stats
say so (`lossy`, `lossy_kl_per_token`).

The fast path (`static_cache=True`, `compile=True`, or a `StaticCausalLMAdapter` passed as the
target) runs the same loop over a preallocated KV cache and compiled forwards
(`heads/static_target.py`): before the clock starts the cache is sized for the request and the
widths the loop will feed (1, K + 1 or the tree size) are compiled; that time is reported apart
(`stats.compile_seconds`), never inside the decoding time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from draftsmith.eval.drafters import Drafter, Proposal
from draftsmith.eval.sampling import (
    SamplingConfig,
    acceptance_probability,
    kl_divergence,
    total_variation,
    verify_chain,
)
from draftsmith.eval.tree import depths as tree_depths
from draftsmith.eval.tree import truncate_tree, verify_tree, verify_tree_greedy, verify_tree_typical
from draftsmith.heads.static_target import StaticCausalLMAdapter, static_adapter
from draftsmith.heads.target import CausalLMAdapter, tree_attention_mask


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


@dataclass
class DecodeStats:
    """Counters of one or more decodes. Merge with `+`.

    `proposed[j]` / `accepted[j]`: drafts proposed / kept at target call j.
    `reached[i]` / `accepted_at[i]`: how often draft position i+1 was verified on the true
    trajectory (every earlier draft accepted) / accepted there.
    Distances (only with `measure_distances=True`), per position, on reached positions:
    sums of KL(p || q) and TV(p, q) of the raw (T=1) distributions and of the exact
    acceptance probability sum_x min(p, q) of the sampling distributions.

    Trees: `proposed[j]` counts nodes, `accepted[j]` the accepted path's length; position i is
    depth i + 1 (reached when the path got to depth i, accepted when it got a node at depth
    i + 1), so alpha_per_position reads P(some candidate at depth i + 1 accepted | reached).
    Distances of a tree: only the expected acceptance at depth 1 (the target mass of the root's
    candidates, or the argmax test at T = 0); no KL/TV. None at all under typical acceptance.

    `lossy`: some call used Medusa's typical acceptance at T > 0 (the output is then NOT the
    target's distribution). `lossy_kl_sum` adds -log p(x) = KL(delta_x || p) for every token
    the typical rule accepted (0 for tokens sampled from p): an estimate of the divergence.
    """

    num_draft_tokens: int = 0
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    new_tokens: int = 0
    drafter_seconds: float = 0.0
    target_seconds: float = 0.0
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    compile_seconds: float = 0.0  # warm-up of compiled forwards (target and drafter), not in total_seconds
    kl_sum: list[float] = field(default_factory=list)
    tv_sum: list[float] = field(default_factory=list)
    accept_prob_sum: list[float] = field(default_factory=list)
    distance_count: list[int] = field(default_factory=list)
    kl_count: list[int] = field(default_factory=list)  # positions with draft distributions
    lossy: bool = False
    lossy_kl_sum: float = 0.0

    def __post_init__(self):
        k = self.num_draft_tokens
        for name in ("reached", "accepted_at", "distance_count", "kl_count"):
            if not getattr(self, name):
                setattr(self, name, [0] * k)
        for name in ("kl_sum", "tv_sum", "accept_prob_sum"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * k)

    def __add__(self, other: "DecodeStats") -> "DecodeStats":
        k = max(self.num_draft_tokens, other.num_draft_tokens)

        def add(a, b):
            a = list(a) + [0] * (k - len(a))
            b = list(b) + [0] * (k - len(b))
            return [x + y for x, y in zip(a, b)]

        return DecodeStats(
            num_draft_tokens=k,
            proposed=self.proposed + other.proposed,
            accepted=self.accepted + other.accepted,
            reached=add(self.reached, other.reached),
            accepted_at=add(self.accepted_at, other.accepted_at),
            new_tokens=self.new_tokens + other.new_tokens,
            drafter_seconds=self.drafter_seconds + other.drafter_seconds,
            target_seconds=self.target_seconds + other.target_seconds,
            prefill_seconds=self.prefill_seconds + other.prefill_seconds,
            ttft_seconds=self.ttft_seconds + other.ttft_seconds,
            total_seconds=self.total_seconds + other.total_seconds,
            compile_seconds=self.compile_seconds + other.compile_seconds,
            kl_sum=add(self.kl_sum, other.kl_sum),
            tv_sum=add(self.tv_sum, other.tv_sum),
            accept_prob_sum=add(self.accept_prob_sum, other.accept_prob_sum),
            distance_count=add(self.distance_count, other.distance_count),
            kl_count=add(self.kl_count, other.kl_count),
            lossy=self.lossy or other.lossy,
            lossy_kl_sum=self.lossy_kl_sum + other.lossy_kl_sum,
        )

    @property
    def target_calls(self) -> int:
        """Decoding calls of the target (the prefill is not one)."""
        return len(self.proposed)

    @property
    def tau(self) -> float:
        """Mean tokens per target call, counting the bonus/correction token (plain decoding = 1)."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts."""
        return sum(self.accepted) / max(1, sum(self.proposed))

    @property
    def alpha(self) -> float:
        """Conditional acceptance over all reached positions (Leviathan's alpha, pooled)."""
        return sum(self.accepted_at) / max(1, sum(self.reached))

    @property
    def alpha_per_position(self) -> list[float | None]:
        """alpha_i = P(draft i accepted | drafts 1..i-1 accepted); None if never reached."""
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    @property
    def lossy_kl_per_token(self) -> float:
        """Estimated KL(emitted || target) per emitted token (0 for lossless decoding)."""
        return self.lossy_kl_sum / max(1, sum(a + 1 for a in self.accepted))

    @staticmethod
    def _mean(sums, counts) -> list[float | None]:
        return [s / c if c else None for s, c in zip(sums, counts)]

    @property
    def kl_per_position(self):
        return self._mean(self.kl_sum, self.kl_count)

    @property
    def tv_per_position(self):
        return self._mean(self.tv_sum, self.kl_count)

    @property
    def expected_alpha_per_position(self):
        """Mean of sum_x min(p, q) at reached positions: the theory for alpha_per_position."""
        return self._mean(self.accept_prob_sum, self.distance_count)


@dataclass
class Generation:
    tokens: list[int]  # the new tokens (prompt excluded)
    stats: DecodeStats


class _Timer:
    def __init__(self, device):
        self.device = device

    def __call__(self) -> float:
        synchronize(self.device)
        return time.perf_counter()


def _as_prompt(input_ids: torch.Tensor) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype != torch.long:
        raise TypeError("input_ids must be a LongTensor")
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be 1-D or [1, T]; got batch {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty 1-D or [1, T] tensor, got {list(input_ids.shape)}")
    return input_ids


def eos_set(eos_token_id) -> set[int]:
    """The stop ids as a set: None, one id, or a list / tensor of ids."""
    if eos_token_id is None:
        return set()
    return {int(t) for t in torch.as_tensor(eos_token_id).flatten().tolist()}


@torch.inference_mode()
def generate(
    target: PreTrainedModel | CausalLMAdapter,
    drafter: Drafter | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int,
    num_draft_tokens: int = 4,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    measure_distances: bool = False,
    typical: tuple[float, float] | None = None,
    static_cache: bool = False,
    compile: bool | str = False,
) -> Generation:
    """Decode up to `max_new_tokens` from `target`, speculating with `drafter` (None = target only).

    Lossless: with sampling the output is distributed exactly as the target's own sampling
    under (temperature, top_k, top_p); with temperature 0 it equals greedy decoding.
    `measure_distances` adds per-position KL/TV/expected-acceptance to the stats (off for
    timing runs: it costs a softmax per position).
    For tree drafters `num_draft_tokens` (K) is the maximum tree depth.
    `typical=(epsilon, delta)` (or the drafter's `typical`) switches to Medusa's typical
    acceptance: NOT lossless at T > 0 (`stats.lossy`); at T = 0 it is plain greedy matching.

    `static_cache=True` decodes the target over a preallocated KV cache; `compile=True` (or
    "max-autotune", see `heads.static_target.COMPILE_MODES`; implies the static cache) also
    compiles its forwards. Both keep the output identical (greedy) or identically distributed
    (sampling). The adapter is made once per model and reused, so compilation is paid once per
    process and width, before the clock starts (`stats.compile_seconds`). A drafter takes its
    own settings (`DraftModelDrafter` / `EagleDrafter(..., static_cache=, compile=)`,
    `MedusaDrafter(..., compile=)`); its compilation happens in its `reserve`, also before the
    clock, and is counted in `stats.compile_seconds` too.
    Passing an adapter as `target` uses it as is (the flags must then be left False).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_draft_tokens < 1:
        raise ValueError(f"num_draft_tokens (K) must be >= 1, got {num_draft_tokens}")
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
    if drafter is None:
        typical = None  # nothing to accept: target-only decoding is exact
    elif typical is None:
        typical = getattr(drafter, "typical", None)
    if typical is not None:
        if len(typical) != 2 or not all(float(v) >= 0 for v in typical):
            raise ValueError(f"typical must be (epsilon, delta) with both >= 0, got {typical!r}")
        # As T -> 0 the target distribution is one-hot and the typical rule is exact argmax
        # matching: greedy decoding stays lossless, only sampling uses the lossy rule.
        typical = None if sampling.greedy else (float(typical[0]), float(typical[1]))
    prompt = _as_prompt(input_ids)
    k_max = num_draft_tokens if drafter is not None else 0
    # Target calls feed the last token and a proposal: compiled widths 1 + each usual size.
    sizes = _drafter_hook(drafter, "proposal_sizes", k_max, default=(k_max,)) if drafter is not None else (0,)
    widths = sorted({1 + int(size) for size in sizes})
    longest = prompt.numel() + max_new_tokens + widths[-1]  # cache slots the request may touch
    if isinstance(target, CausalLMAdapter):
        if static_cache or compile:
            raise ValueError(
                "static_cache/compile apply when target is a model; an adapter is used as it is "
                "(pass a StaticCausalLMAdapter for the static path)"
            )
        adapter = target
    elif static_cache or compile:
        adapter = static_adapter(target, longest, compile=compile)
    else:
        adapter = CausalLMAdapter(target)
    device = adapter.device
    prompt = prompt.to(device)
    eos = eos_set(eos_token_id)
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    layers = tuple(getattr(drafter, "target_layers", ())) if drafter is not None else ()

    stats = DecodeStats(num_draft_tokens=k_max, lossy=typical is not None)
    # Outside the clock: size the caches for this request and compile what the loop will run.
    if isinstance(adapter, StaticCausalLMAdapter):
        adapter.reserve(longest)
        stats.compile_seconds += adapter.warm_up(widths, hidden_layers=layers)
    if drafter is not None:
        stats.compile_seconds += _drafter_hook(drafter, "reserve", prompt.numel() + max_new_tokens, k_max, sampling, default=0.0)
    now = _Timer(device)
    seq = torch.empty(prompt.numel() + max_new_tokens + k_max + 1, dtype=torch.long, device=device)
    seq[: prompt.numel()] = prompt
    length = prompt.numel()
    new: list[int] = []

    start = now()
    adapter.reset()
    prefill = None
    if length > 1:
        prefill = adapter.forward(prompt[:-1].unsqueeze(0), logits_to_keep=1, hidden_layers=layers)
    stats.prefill_seconds = now() - start
    if drafter is not None:
        drafter.start(prompt)
        if layers and prefill is not None:
            drafter.observe({i: h[0] for i, h in prefill.hidden_states.items()})

    while len(new) < max_new_tokens:
        # Never draft past the budget: the call emits at most k + 1 tokens (k = tree depth).
        k = min(k_max, max_new_tokens - len(new) - 1)
        proposal = None
        if k > 0:
            t0 = now()
            proposal = drafter.propose(seq[:length], k, sampling, generator)
            stats.drafter_seconds += now() - t0
            k = len(proposal)
        depth = k  # positions of the per-position stats: the chain length or the tree depth
        last = seq[length - 1 : length]
        if k and (proposal.parents is not None or typical is not None):
            t0 = now()
            path, nxt, tokens, depth, kl, hidden = _tree_call(
                adapter, proposal, last, length - 1, min(k_max, max_new_tokens - len(new) - 1),
                sampling, typical, generator, layers, stats if measure_distances else None,
            )
            k, n = len(tokens), len(path)
            emitted = [tokens[i] for i in path] + [nxt]
            seq[length : length + n + 1] = torch.tensor(emitted, device=device)
            stats.target_seconds += now() - t0
            stats.lossy_kl_sum += kl
            if layers:
                drafter.observe(hidden)
            if proposal.parents is None:
                drafter.accepted(n)  # a chain under typical acceptance: path = its first n drafts
            else:
                drafter.accepted_path(path)
        else:
            t0 = now()
            drafts = proposal.tokens.to(device) if k else seq[:0]
            fed = (torch.cat([last, drafts]) if k else last).unsqueeze(0)
            out = adapter.forward(fed, hidden_layers=layers)
            logits = out.logits[0]  # [k+1, V]
            # One device->host copy per call (the accepted count and the emitted tokens together).
            if sampling.greedy:
                # `verify_chain_greedy` on host lists: keep the drafts that equal the target's
                # argmax, then emit the argmax at the first mismatch (or the bonus). argmax needs
                # no float copy of the logits: a bf16 -> fp32 cast is exact and keeps the order.
                choice = logits.argmax(-1)  # [k+1]
                ids = torch.cat([choice, drafts]).tolist() if k else choice.tolist()
                n = 0
                while n < k and ids[k + 1 + n] == ids[n]:
                    n += 1
                emitted = ids[: n + 1]  # drafts[:n] equal choice[:n]
                seq[length : length + n + 1] = choice[: n + 1]
                p = None
            else:
                logits = logits.float()
                p = sampling.probs(logits)
                q = proposal.probs.to(device)[None] if k and proposal.probs is not None else None
                n, nxt = verify_chain(p[None], drafts[None], q, generator)
                nxt = nxt.to(device)
                ids = torch.cat([n.to(device), nxt, drafts]).tolist()
                n = ids[0]
                emitted = ids[2 : 2 + n] + ids[1:2]
                seq[length : length + n + 1] = torch.cat([drafts[:n], nxt])
            # The cache held length-1 tokens and was fed k+1: keep the last token and n drafts.
            adapter.crop(length + n)
            stats.target_seconds += now() - t0
            if layers:
                drafter.observe({i: h[0, : n + 1] for i, h in out.hidden_states.items()})
            if drafter is not None and k:
                drafter.accepted(n)
            if measure_distances and k:
                _add_distances(stats, logits.float(), p, proposal, sampling, reached=min(n + 1, k))
        length += n + 1
        if not new:
            stats.ttft_seconds = now() - start
        stats.proposed.append(k)
        stats.accepted.append(n)
        for i in range(min(n + 1, depth)):
            stats.reached[i] += 1
            stats.accepted_at[i] += int(i < n)
        hit = next((i for i, t in enumerate(emitted) if t in eos), None)
        new.extend(emitted if hit is None else emitted[: hit + 1])
        if hit is not None:
            break

    stats.new_tokens = len(new)
    stats.total_seconds = now() - start
    return Generation(tokens=new, stats=stats)


def _drafter_hook(drafter, name, *args, default):
    """drafter.name(*args), or `default` for a drafter written before the hook existed."""
    hook = getattr(drafter, name, None)
    return default if hook is None else hook(*args)


def _tree_call(adapter, proposal, last, past_len, max_depth, sampling, typical, generator, layers, stats):
    """Verify a tree proposal (or, under typical acceptance, a chain) in one target forward.

    Feeds [last] + nodes with the tree mask at positions past_len + depth, picks the accepted
    path, compacts the cache to past + last + path. Returns (path, next_token, node tokens,
    depth of the verified tree, kl, hidden states of last + path).
    """
    if proposal.probs is not None:
        raise ValueError(
            "tree proposals (and typical acceptance) need deterministic candidates: the proposal "
            "must have probs=None; a sampled draft distribution cannot be verified node by node"
        )
    n = len(proposal)
    parents = list(range(-1, n - 1)) if proposal.parents is None else [int(q) for q in proposal.parents]
    if len(parents) != n:
        raise ValueError(f"the proposal has {n} tokens but {len(parents)} parents")
    device = adapter.device
    tokens_t = proposal.tokens.to(device)
    depth = tree_depths(parents)
    if max(depth) > max_depth:  # the budget: the call emits at most depth + 1 tokens
        keep = truncate_tree(parents, max_depth)
        where = {old: new for new, old in enumerate(keep)}
        parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in keep]
        depth = [depth[i] for i in keep]
        tokens_t = tokens_t[torch.tensor(keep, device=device)]
        n = len(keep)
    # Fed row 0 is `last` (depth 0); node i is row i + 1.
    fed_parents = [-1] + [q + 1 if q >= 0 else 0 for q in parents]
    mask, fed_depth = tree_attention_mask(fed_parents, past_len, dtype=adapter.model.dtype, device=device)
    fed = torch.cat([last, tokens_t]).unsqueeze(0)
    out = adapter.forward(
        fed, position_ids=(past_len + fed_depth).unsqueeze(0), attention_mask=mask, hidden_layers=layers
    )
    logits = out.logits[0]  # [n + 1, V]
    kl, p = 0.0, None
    if sampling.greedy:
        ids = torch.cat([logits.argmax(-1), tokens_t]).tolist()  # one device->host copy
        tokens = ids[n + 1 :]
        path, nxt = verify_tree_greedy(ids[: n + 1], parents, tokens)
    else:
        tokens = tokens_t.tolist()
        p = sampling.probs(logits.float())
        if typical is None:
            path, nxt = verify_tree(p, parents, tokens, generator)
        else:
            path, nxt, kl = verify_tree_typical(logits, p, parents, tokens, sampling.temperature, *typical, generator)
    rows = [0] + [i + 1 for i in path]
    adapter.keep(past_len, rows)
    hidden = {}
    if layers:
        index = torch.tensor(rows, device=device)
        hidden = {i: h[0].index_select(0, index.to(h.device)) for i, h in out.hidden_states.items()}
    if stats is not None and typical is None:
        # Expected acceptance at depth 1: recursive rejection accepts one of the root's
        # candidates with probability p(set of their distinct tokens); greedy: argmax among them.
        roots = sorted({tokens[i] for i, q in enumerate(parents) if q < 0})
        if p is None:
            expected = float(ids[0] in roots)
        else:
            expected = float(p[0, torch.tensor(roots, device=p.device)].sum())
        stats.accept_prob_sum[0] += expected
        stats.distance_count[0] += 1
    return path, nxt, tokens, max(depth), kl, hidden


def _add_distances(stats, logits, p, proposal: Proposal, sampling, reached: int) -> None:
    """Per-position distances on the positions whose context is the true trajectory."""
    tokens = proposal.tokens[:reached].to(logits.device)
    if sampling.greedy:
        expected = (logits[:reached].argmax(-1) == tokens).float()
    elif proposal.probs is None:  # deterministic: accepted with probability p(x)
        expected = p[:reached].gather(-1, tokens[:, None]).squeeze(-1)
    else:
        expected = acceptance_probability(p[:reached], proposal.probs[:reached].to(p.device))
    if proposal.logits is not None:
        p_raw = torch.softmax(logits[:reached], -1)
        q_raw = torch.softmax(proposal.logits[:reached].to(logits.device).float(), -1)
        kl, tv = kl_divergence(p_raw, q_raw).tolist(), total_variation(p_raw, q_raw).tolist()
    else:
        kl = tv = None
    for i, e in enumerate(expected.tolist()):
        stats.accept_prob_sum[i] += e
        stats.distance_count[i] += 1
        if kl is not None:
            stats.kl_sum[i] += kl[i]
            stats.tv_sum[i] += tv[i]
            stats.kl_count[i] += 1
