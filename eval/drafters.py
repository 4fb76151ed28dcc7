"""Drafters: what proposes tokens for the target to verify.

The contract (one sequence at a time; the decoder drives it):

    drafter.start(prompt_ids)                   a new sequence begins
    proposal = drafter.propose(context, k, sampling, generator)
    drafter.accepted(n)                         n of the proposed tokens were kept

`context` is every token so far (prompt + emitted). A proposal carries the tokens, and either
the exact distributions `probs` they were drawn from, or `probs=None` for a deterministic
proposal (q = 1 on each proposed token). Optionally `logits`: the drafter's raw (T=1)
logits, used only for the KL/TV report. A drafter may propose fewer than k tokens, or none.

Tree drafters (Medusa, EAGLE) extend `Proposal` with parent links; the chain is the tree in
which every node's parent is the node before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from draftsmith.eval.sampling import SamplingConfig, draw
from draftsmith.heads.target import CausalLMAdapter


@dataclass
class Proposal:
    tokens: torch.Tensor  # [k] long, on the drafter's device
    probs: torch.Tensor | None = None  # [k, V] exactly what each token was drawn from
    logits: torch.Tensor | None = None  # [k, V] raw logits for distance reports

    def __len__(self) -> int:
        return self.tokens.shape[0]


class Drafter:
    """Base class; subclasses implement `propose` and, if they keep state, `start`/`accepted`."""

    name = "drafter"
    #: True when proposals are deterministic (no distribution): q = 1 on each token.
    deterministic = False

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


class DraftModelDrafter(Drafter):
    """Any HF causal LM that shares the target's vocabulary, with its own KV cache.

    The draft samples with the target's sampling settings (same temperature, top-k, top-p) and
    returns the warped distribution it sampled from as q, so q is by construction the
    distribution of the proposed token. `vocab_size` aligns the draft's logits to the
    target's when one of them pads its embedding matrix (tokens past the tokenizer never occur).
    """

    deterministic = False

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, name: str = "draft"):
        self.adapter = CausalLMAdapter(model)
        self.vocab_size = vocab_size or self.adapter.vocab_size
        self.name = name
        self._kept = 0  # tokens of the context that are in the draft cache after `accepted`
        self._drafted_from = 0

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
