"""A chain drafter that records what the decoder did with it, call by call, without changing it.

    recorder = RecordingDrafter(drafter)
    result = generate_batch(target, prompts, recorder, num_draft_tokens=K, max_new_tokens=N)
    calls = recorder.calls(result)          # per row: [DraftCall(anchor, drafts, accepted, emitted), ...]

The decoder (`decoding/loop.py`) is untouched: the recorder stands between it and any chain
drafter behind the Drafter contract (`decoding/drafters.py`), passing every hook through, so the
decode is the one it would be without it (tests/test_onpolicy.py compares the two).

Where each fact comes from:
- `propose`: each active row's context length (the call's anchor) and the drafts of its chain, as
  many as the decoder verifies (the row's budget cuts a longer proposal, as `loop._Call` does);
- `select`: which rows are still decoding (the decoder drops finished rows from the batch);
- `accepted`: the accepted count and the committed tokens (the accepted drafts, then the correction
  at the first rejection or the bonus token) of every row that goes on.
A row that finishes in a call gets no `accepted`: that call's outcome is read from the decoder's own
per-row record (`BatchResult.rows[r].accepted`, `BatchResult.tokens[r]`), which `calls` also checks
every hooked call against. The emitted tokens are the lossless decoder's, so prompt + emitted is a
sequence distributed exactly as the target's own sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.decoding.drafters import Drafter, Proposal
from draftsmith.decoding.stats import BatchResult


@dataclass(frozen=True)
class DraftCall:
    """One target call of one row."""

    anchor: int  # the row's length when the call was made (prompt + emitted so far): its context
    drafts: tuple[int, ...]  # the chain verified (target ids); empty when the row had no budget left
    accepted: int  # how many of `drafts` the verifier kept (a prefix)
    emitted: tuple[int, ...]  # what the call added: the accepted drafts, then the correction or bonus
    # token (shorter when the row stopped at an eos among them)

    @property
    def rejected(self) -> bool:
        """Whether the verifier rejected a draft (then `emitted[accepted]` is the correction)."""
        return self.accepted < len(self.drafts)

    @property
    def correction(self) -> int | None:
        """The token emitted in place of the first rejected draft (None: none rejected, or cut at an eos)."""
        return self.emitted[self.accepted] if self.rejected and len(self.emitted) > self.accepted else None


class RecordingDrafter(Drafter):
    """`drafter` (a chain drafter), every hook passed through, each call of each row recorded."""

    def __init__(self, drafter: Drafter):
        if drafter.trees:
            raise ValueError(f"drafter {drafter.name!r} proposes trees; the recorder records chains")
        self.inner = drafter
        self.name, self.target_layers, self.typical = drafter.name, drafter.target_layers, drafter.typical
        self.max_depth, self.cost_per_step = drafter.max_depth, drafter.cost_per_step
        self._rows: list[int] = []  # the prompt index of each row still decoding, in the decoder's order
        self._prompt: list[int] = []  # per prompt: its length
        self._length: list[int] = []  # per prompt: its committed tokens, as far as the hooks have seen
        self._drafts: list[dict[int, tuple[int, ...]]] = []  # per prompt: anchor -> the drafts verified there
        self._hooked: list[dict[int, tuple[int, tuple[int, ...]]]] = []  # per prompt: anchor -> (accepted, committed)

    def max_positions(self) -> int | None:
        return self.inner.max_positions()

    def proposal_sizes(self, num_tokens: int) -> tuple[int, ...]:
        return self.inner.proposal_sizes(num_tokens)

    def prepare(self, *args, **kwargs) -> float:
        return self.inner.prepare(*args, **kwargs)

    def start(self, prompts, prefill, vocab_size) -> None:
        self.inner.start(prompts, prefill, vocab_size)
        self._rows = list(range(len(prompts)))
        self._prompt = [len(p) for p in prompts]
        self._length = list(self._prompt)
        self._drafts = [{} for _ in prompts]
        self._hooked = [{} for _ in prompts]

    def propose(self, contexts, num_tokens, sampling, generators) -> Proposal:
        proposal = self.inner.propose(contexts, num_tokens, sampling, generators)
        tokens = proposal.tokens.tolist()  # [B, N]: one copy to the host
        for i, (row, context, budget) in enumerate(zip(self._rows, contexts, num_tokens)):
            if len(context) != self._length[row]:
                raise RuntimeError(
                    f"recorder out of step: row {row} has {len(context)} tokens, its hooks saw {self._length[row]}"
                )
            self._drafts[row][len(context)] = tuple(tokens[i][: min(proposal.counts[i], budget)])
        return proposal

    def select(self, rows, kept) -> None:
        self.inner.select(rows, kept)
        self._rows = [self._rows[i] for i in kept]

    def accepted(self, num_accepted, committed, hidden) -> None:
        self.inner.accepted(num_accepted, committed, hidden)
        for row, n, tokens in zip(self._rows, num_accepted, committed.tolist()):  # committed [R, W]
            self._hooked[row][self._length[row]] = (n, tuple(tokens[: n + 1]))
            self._length[row] += n + 1

    def calls(self, result: BatchResult) -> list[list[DraftCall]]:
        """Per prompt of the last decode (`result` is what it returned), its calls in order.
        RuntimeError when the hooks and the decoder's record disagree."""
        out = []
        for row, (stats, tokens) in enumerate(zip(result.rows, result.tokens)):
            at, calls = self._prompt[row], []
            for proposed, accepted in zip(stats.proposed, stats.accepted):
                drafts = self._drafts[row].get(at, ())  # no proposal: the call had no budget to draft
                done = at - self._prompt[row]
                emitted = tuple(tokens[done : done + accepted + 1])
                hooked = self._hooked[row].get(at)
                kept = min(accepted, len(emitted))
                if (
                    len(drafts) != proposed
                    or drafts[:kept] != emitted[:kept]
                    or (hooked is not None and hooked != (accepted, emitted))
                ):
                    raise RuntimeError(
                        f"recorder out of step at row {row}, anchor {at}: drafts {drafts}, hooks {hooked}; the "
                        f"decoder says {proposed} proposed, {accepted} accepted, emitted {emitted}"
                    )
                calls.append(DraftCall(at, drafts, accepted, emitted))
                at += accepted + 1
            out.append(calls)
        return out
