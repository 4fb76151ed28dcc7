"""Sliding-window targets (Mistral; Qwen2 with full and sliding layers) on both KV stores: the
window (5) is narrower than the sequences, so a cache that ignored it would decode differently."""

import copy

import pytest
import torch
from fixtures import windowed_model

from draftsmith.decoding import DraftModelDrafter, PromptLookupDrafter, generate, generate_batch, row_seed
from draftsmith.decoding.sampling import SamplingConfig

N_NEW = 16
PROMPTS = [torch.tensor(p) for p in ([5, 9, 14, 9, 14, 30, 41, 9, 14], [7], [60, 61, 62, 63, 60, 61, 62], [3, 4])]


@torch.no_grad()
def _reference(model, prompt, n):
    """Greedy by full recomputation: HF builds its own sliding-window mask every step."""
    seq = prompt.tolist()
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[prompt.numel() :]


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def target(request):
    return windowed_model(request.param)


def _drafters(target):
    return [None, PromptLookupDrafter(), DraftModelDrafter(copy.deepcopy(target))]


@pytest.mark.parametrize("static", [False, True])
def test_greedy_equals_target_greedy(target, static):
    unwindowed = copy.deepcopy(target)
    unwindowed.config.sliding_window = 10_000  # wider than every sequence
    accepted = 0
    for prompt in PROMPTS[:2]:
        reference = _reference(target, prompt, N_NEW)
        assert reference != _reference(unwindowed, prompt, N_NEW)  # the window matters
        for drafter in _drafters(target):
            out = generate(target, drafter, prompt, max_new_tokens=N_NEW, num_draft_tokens=3, static_cache=static)
            assert out.tokens == reference, (drafter, prompt)
            accepted += sum(out.stats.accepted)
    assert accepted > 0


@pytest.mark.parametrize("static", [False, True])
def test_batched_equals_batch_one(target, static):
    """Right-aligned prompts of different lengths: every row decodes as it would alone."""
    for temperature in (0.0, 1.0):
        sampling = SamplingConfig(temperature=temperature)
        draft = copy.deepcopy(target)
        batch = generate_batch(
            target,
            PROMPTS,
            DraftModelDrafter(draft),
            max_new_tokens=N_NEW,
            num_draft_tokens=3,
            sampling=sampling,
            seed=3,
            static_cache=static,
        )
        for b, prompt in enumerate(PROMPTS):
            alone = generate(
                target,
                DraftModelDrafter(draft),
                prompt,
                max_new_tokens=N_NEW,
                num_draft_tokens=3,
                temperature=temperature,
                seed=row_seed(3, b),
                static_cache=static,
            )
            assert batch.tokens[b] == alone.tokens, (b, temperature)
