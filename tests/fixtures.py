"""Test fixtures: the toy models of `draftsmith.heads.toy`, re-exported for the tests."""

from draftsmith.heads.toy import (  # noqa: F401
    CORPUS,
    DRAFT_NOISE,
    FAMILIES,
    HEAD_SCALE,
    VOCAB,
    tiny_config,
    tiny_model,
    tiny_pair,
    tiny_tokenizer,
    write_toy,
)


def save_pair(tmp_path, family: str = "llama", seed: int = 0):
    """Write a target and a draft with the tokenizer to `tmp_path/{target,draft}`."""
    paths = write_toy(tmp_path, family, seed)
    return paths["target"], paths["draft"]


def windowed_model(family: str, window: int = 5, seed: int = 0):
    """A tiny target with sliding-window attention narrower than the tests' sequences: mistral
    slides on every layer (one mask); qwen2 has a full layer, then sliding ones (a mask per kind)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, layers=3)
    config.sliding_window = window
    if family == "qwen2":
        config.use_sliding_window, config.layer_types = True, ["full_attention"] + ["sliding_attention"] * 2
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.generation_config.eos_token_id = None
    return model.eval()


def greedy_answers_batch(target, lengths=(4, 6, 4, 5, 4, 7, 4, 3), new_tokens: int = 40, seed: int = 0):
    """(prompts, batch, states): random prompts of `lengths`, the target's greedy answers of
    `new_tokens` as one right-padded batch (input_ids, attention_mask, loss_mask on the answers),
    and the target's outputs on it with every hidden state: what a head is fitted to in a test."""
    import torch

    from draftsmith.decoding import generate_batch

    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in lengths]
    out = generate_batch(target, prompts, None, max_new_tokens=new_tokens)
    width = max(len(p) + new_tokens for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids, dtype=torch.bool)
    for b, (p, o) in enumerate(zip(prompts, out.tokens)):
        row = torch.cat([p, torch.tensor(o)])
        ids[b, : len(row)], attention[b, : len(row)], loss_mask[b, len(p) : len(row)] = row, 1, True
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    with torch.no_grad():
        states = target(ids, attention_mask=attention, output_hidden_states=True)
    return prompts, batch, states


def first_line_prompts(toy_dir, path, count: int):
    """Write the first line of each of the first `count` toy prompts to `path` (short requests,
    which fit the 128-slot cache of the compiled tests) and return `path`."""
    import json

    lines = (toy_dir / "prompts.jsonl").read_text().splitlines()[:count]
    path.write_text("".join(json.dumps({"prompt": json.loads(x)["prompt"].splitlines()[0]}) + "\n" for x in lines))
    return path


def fake_vocab_map(size: int):
    """A draft vocabulary of `size` tokens of the toy vocabulary, drawn at random (seed 0)."""
    import torch

    from draftsmith.distill.vocab import build_vocab_map

    counts = torch.zeros(VOCAB, dtype=torch.long)
    counts[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))[:size]] = 5
    return build_vocab_map(counts, size, "d" * 64)


def block_hidden(target, head, context, block_size: int):
    """A block head's hidden states for the block after `context`, recomputed from scratch: the
    head's backbone over the target's features of every token but the last, the block being that
    last token and `block_size - 1` mask tokens."""
    import torch

    n = len(context) - 1
    feats = context_features(target, head, context)
    block = torch.tensor([[context[-1]] + [head.config.mask_token_id] * (block_size - 1)])
    mask = torch.zeros(1, 1, block_size, n + block_size)
    return head.hidden(block, feats, positions=torch.arange(n + block_size)[None], attention_mask=mask)


def path_of(proposal, tokens: list[int]) -> list[int]:
    """The node indices of row 0's root-to-node path that spells `tokens` (siblings differ)."""
    parents, ids = proposal.parents[0], proposal.tokens[0].tolist()
    path, parent = [], -1
    for token in tokens:
        parent = next(i for i, q in enumerate(parents) if q == parent and ids[i] == token)
        path.append(parent)
    return path


def anchored_blocks(target, head, recipe, losses):
    """A block head's held-out blocks anchored at every position of the toy target's greedy
    answers (`every_block`, with the head's training `losses`): (chains, starts)."""
    from draftsmith.train.blocks import every_block

    _, batch, states = greedy_answers_batch(target)
    chains, starts, _, _ = every_block(head, batch, aux_features(states, head), states.logits, recipe, None, losses)
    return chains, starts


def aux_features(states, head):
    """The target's hidden states at the head's aux layers (`states` with every hidden state),
    concatenated on the last dimension: a head's input features."""
    import torch

    return torch.cat([states.hidden_states[i] for i in head.config.aux_layer_ids], -1)


def context_features(target, head, context):
    """The head's projected features of every token of `context` but the last, from one full
    target forward over the whole context."""
    import torch

    n = len(context) - 1
    hidden = target(torch.tensor([context]), output_hidden_states=True).hidden_states
    return head.project(torch.cat([hidden[i][:, :n] for i in head.config.aux_layer_ids], -1))


def fit_steps(head, loss_of, steps: int, lr: float = 1e-2) -> list[float]:
    """Fit `head`'s trainable parameters with AdamW at `lr` for `steps` steps, `loss_of(step)`
    giving each step's loss; the losses, step by step."""
    import torch

    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        loss = loss_of(step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def fit_block_head(
    head, batch, states, recipe, losses_fn, steps: int, block_size: int, loss_mask=None, with_step=False
):
    """`fit_steps` of a block head on the target's greedy answers (`batch`, `states`): each step
    `losses_fn` over 32 anchors drawn (seed: the step) where `loss_mask` (default: the batch's)
    holds, the step handed in the batch when `with_step`; the losses."""
    import torch

    from draftsmith.train.blocks import sample_anchors

    feats = aux_features(states, head)
    mask = batch["loss_mask"] if loss_mask is None else loss_mask

    def loss_of(step):
        gen = torch.Generator().manual_seed(step)
        anchors, valid = sample_anchors(mask, batch["attention_mask"], block_size, 32, gen)
        rows = {**batch, "step": step} if with_step else batch
        return losses_fn(head, rows, feats, states.logits, anchors, valid, recipe, None)[0]

    return fit_steps(head, loss_of, steps)


def checking_drafter_class(drafter_class, check_row, raw_logits: bool = False):
    """A subclass of `drafter_class`, built as `(head, target)`, that after each proposal calls
    `check_row(drafter, b, context, proposal, sampling)` on each row: `.checked` counts the rows
    it reports checked (a true return), `.calls` the proposals; with `raw_logits`, `prepare` has
    each proposal keep its raw logits."""

    class Checked(drafter_class):
        def __init__(self, head, target):
            super().__init__(head)
            self.target, self.checked, self.calls = target, 0, 0

        if raw_logits:

            def prepare(self, *args, **kwargs):
                return super().prepare(*args[:5], logits=True)  # the check reads each proposal's raw logits

        def propose(self, contexts, num_tokens, sampling, generators):
            proposal = super().propose(contexts, num_tokens, sampling, generators)
            for b, context in enumerate(contexts):
                self.checked += bool(check_row(self, b, context, proposal, sampling))
            self.calls += 1
            return proposal

    return Checked


def decode_ragged_sampled(target, prompts, drafter, num_draft_tokens: int, sampling):
    """Sampled decoding (seed 3, 12 new tokens, no gradients) of ragged rows at batch 3: prompts
    0, the first 2 tokens of 1, and 5; the batch's output."""
    import torch

    from draftsmith.decoding import generate_batch

    with torch.no_grad():
        return generate_batch(
            target,
            [prompts[0], prompts[1][:2], prompts[5]],
            drafter,
            num_draft_tokens=num_draft_tokens,
            max_new_tokens=12,
            sampling=sampling,
            seed=3,
        )


def assert_rows_leaving_are_checked(fitted, drafter_class, check_row, num_draft_tokens: int, temperature: float):
    """Decoding at `temperature` of ragged rows (prompts 0, 1 and the first token of 2, 16 new
    tokens) where row 1 leaves the batch early (its first token is the end token), with a
    `drafter_class` drafter of the fitted `(target, head, prompts)` whose every proposal of every
    row `check_row` checks on its raw logits: at least 5 proposals, and some drafts accepted."""
    from draftsmith.decoding import generate_batch
    from draftsmith.decoding.sampling import SamplingConfig

    target, head, prompts = fitted
    drafter = checking_drafter_class(drafter_class, check_row, raw_logits=True)(head, target)
    rows = [prompts[0], prompts[1], prompts[2][:1]]
    out = generate_batch(
        target,
        rows,
        drafter,
        num_draft_tokens=num_draft_tokens,
        max_new_tokens=16,
        sampling=SamplingConfig(temperature=temperature),
        eos_token_id=rows[1][0].item(),
    )
    assert drafter.calls >= 5 and sum(sum(r.accepted) for r in out.rows) > 0


def parameter_counts(head) -> tuple[int, int]:
    """(trained, frozen): how many of the head's parameters require gradients, and how many not."""
    trained = sum(p.numel() for p in head.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in head.parameters() if not p.requires_grad)
    return trained, frozen


def assert_lossless(target, drafter, prompt, samples: int, batch_size: int, rate=(0.05, 0.95), **settings):
    """`check_lossless` of `drafter` on `prompt` (2 drafts, no progress bar, `settings` on top):
    its acceptance rate lies strictly inside `rate` and the chi-square test passes."""
    from draftsmith.eval.lossless import check_lossless

    result = check_lossless(
        target, drafter, prompt, num_draft_tokens=2, samples=samples, progress=False, batch_size=batch_size, **settings
    )
    assert rate[0] < result.acceptance_rate < rate[1], result.describe()
    assert result.passed, result.describe()


def assert_walk_is_decoded(target, drafter, prompts, chains, starts, num_draft_tokens: int):
    """The walk over the held-out `chains` anchored at `starts` makes the calls greedy decoding of
    `prompts` (41 new tokens) with `drafter` makes, with the same tau, above 1.5."""
    import pytest

    from draftsmith.distill.acceptance import walk_tau
    from draftsmith.train.common import decoded_tau

    tokens, calls = walk_tau(chains, starts)
    # The decoder leaves out calls cut short by the budget, the walk those running past the answer:
    # 41 new tokens make them the same calls.
    tau, decoder_calls, _ = decoded_tau(target, drafter, [p.tolist() for p in prompts], num_draft_tokens, 41)
    assert (calls, tokens / calls) == (decoder_calls, pytest.approx(tau)) and tau > 1.5


def block_head(head_class, target, block_size: int, seed: int = 0, aux=(0, 1, 2), **config):
    """A `head_class` block head for `target`, its weights drawn after `torch.manual_seed(seed)`: mask
    token VOCAB - 1, hidden states `aux`, and the head config's own keys `config`."""
    import torch

    torch.manual_seed(seed)
    shape = dict(block_size=block_size, mask_token_id=VOCAB - 1, aux_layer_ids=list(aux))
    return head_class.for_target(target, **shape, **config)


def assert_greedy_is_target_only(
    target,
    drafter_class,
    head,
    prompts,
    num_draft_tokens: int,
    rows: int = 4,
    singles: int = 2,
    min_accepted: int = 10,
    min_batch_accepted: int = 0,
    drafts_every_slot: bool = False,
):
    """Greedy decoding with a fresh `drafter_class(head)` gives the target-only tokens: each of the
    first `singles` prompts alone (at least `min_accepted` drafts accepted in all, so the cache
    moves run; with `drafts_every_slot`, each decode's widest proposal is `num_draft_tokens`),
    the first `rows` as one batch (at least `min_batch_accepted` accepted) on the growing store and
    on the preallocated one (the same accepted drafts per row), and that batch at a budget of 2
    below the block, where the drafter proposes only 2 tokens."""
    from draftsmith.decoding import generate, generate_batch

    references = [generate(target, None, p, max_new_tokens=24).tokens for p in prompts[:rows]]
    accepted = 0
    for p, reference in zip(prompts[:singles], references):
        out = generate(target, drafter_class(head), p, max_new_tokens=24, num_draft_tokens=num_draft_tokens)
        assert out.tokens == reference
        accepted += sum(out.stats.accepted)
        if drafts_every_slot:
            assert max(out.stats.proposed) == num_draft_tokens
    assert accepted >= min_accepted, accepted
    sized = dict(num_draft_tokens=num_draft_tokens, max_new_tokens=24)
    batch = generate_batch(target, prompts[:rows], drafter_class(head), **sized)
    assert batch.tokens == references and sum(sum(r.accepted) for r in batch.rows) >= min_batch_accepted
    static = generate_batch(target, prompts[:rows], drafter_class(head), **sized, static_cache=True)
    assert static.tokens == references and [r.accepted for r in static.rows] == [r.accepted for r in batch.rows]
    out = generate_batch(target, prompts[:rows], drafter_class(head), num_draft_tokens=2, max_new_tokens=24)
    assert out.tokens == references and max(max(r.proposed) for r in out.rows) == 2


def teacher_forced_blocks(head, batch, feats, anchors, block_size: int):
    """(final-norm states [B*A, Bs, H], the block's data tokens [B*A, Bs]) of the head's
    teacher-forced blocks at `anchors` of `batch`, over the target's features `feats`."""
    import torch

    from draftsmith.decoding.masks import additive
    from draftsmith.train.blocks import anchor_block_mask, block_inputs

    ids, (B, T), A = batch["input_ids"], batch["input_ids"].shape, anchors.shape[1]
    block_ids, slot_pos = block_inputs(ids, anchors, block_size, head.config.mask_token_id)
    positions = torch.cat([torch.arange(T)[None].expand(B, T), slot_pos], dim=1)
    mask = additive(anchor_block_mask(anchors, batch["attention_mask"], block_size), head.dtype)[:, None]
    with torch.no_grad():
        h = head.hidden(block_ids, head.project(feats), positions=positions, attention_mask=mask)
    return h.view(B * A, block_size, -1), ids.gather(1, slot_pos.clamp(max=T - 1)).view(B * A, block_size)


def speculators_blocks(head, inputs: dict, indices) -> dict:
    """A DFlash-family head over the blocks speculators anchored (`indices`: the blocks' token
    positions in `inputs`' one row) as the judge's `_block_outputs` lays them out: the slots'
    final-norm states and logits; DSpark's corrected and confidence logits, the block's own tokens
    the previous ones; DFlash2's top-K candidates of each slot and their edge scores after the
    block's previous token (the anchor for slot 0, as speculators' `_predecessor_ids`)."""
    import torch

    B, ids = head.config.block_size, inputs["input_ids"]
    anchors = indices.view(-1, B)[:, 0][None]  # [1, A]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    blocks, _ = teacher_forced_blocks(head, batch, inputs["hidden_states"], anchors, B)  # [A, Bs, H]
    h, tokens = blocks.reshape(-1, blocks.shape[-1]), ids[0, indices].view(-1, B)
    with torch.no_grad():
        out = {"hidden": h, "logits": head.lm_head(h)}
        if getattr(head, "markov_head", None) is not None:
            out["corrected"] = head.block_logits(blocks, tokens).reshape(-1, head.config.draft_vocab_size)
            out["confidence"] = head.confidence(blocks, tokens).reshape(-1)
        if hasattr(head, "edge_scores"):
            prev = torch.cat([tokens[:, :1], tokens[:, :-1]], 1).reshape(-1)  # [A*Bs]
            out["candidates"] = head.candidates(out["logits"])
            out["scores"] = head.edge_scores(out["logits"], h, prev, out["candidates"])
    return out


def record_accepted(recorder, proposal, committed, n: int, observed) -> bool:
    """Log one `accepted` call on a recording drafter (batch 1): the event, the target states it
    was handed (`observed`), and, after a tree `proposal` that drafted, the node path spelled by
    the `n` accepted tokens of `committed` (in `recorder.paths`); whether a path was logged."""
    recorder.events.append("accepted")
    recorder.observed.append(observed)
    if proposal is not None and proposal.parents is not None and proposal.counts[0]:
        recorder.paths.append(path_of(proposal, committed[0, :n].tolist()))
        return True
    return False
