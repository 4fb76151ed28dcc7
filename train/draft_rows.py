"""The draft trainer's rows (`train/draft.py`): the target's answers or fixed text as token rows with
their loss masks, collated into batches, and the on-policy batches the draft samples itself.

    rows = generated_rows(DistillData("runs/smollm2/data"))   # loss on the answer tokens
    rows = fixed_rows("text.jsonl", tokenizer, 256)           # loss on every token but each window's first
    batch = collate(rows, [0, 1, 2], max_length=256, pad_id=0)
"""

from __future__ import annotations

import math

import torch

from draftsmith.distill.data import DistillData
from draftsmith.train.common import reading
from draftsmith.train.recipe import RecipeError


class Rows:
    """Token rows and loss masks (1 = the draft learns to predict this token)."""

    def __init__(self, ids: list[list[int]], masks: list[list[int]], prompt_lengths: list[int], origin: str):
        self.ids, self.masks, self.prompt_lengths, self.origin = ids, masks, prompt_lengths, origin

    def __len__(self):
        return len(self.ids)

    def every_token(self) -> Rows:
        """The same rows with every token but each row's first trained (recipe `train_on: all`)."""
        return Rows(self.ids, [[0] + [1] * (len(ids) - 1) for ids in self.ids], self.prompt_lengths, self.origin)


def generated_rows(data: DistillData) -> Rows:
    with reading(data):
        ds = data.dataset
        ids, masks, prompt_lengths = (
            [list(r) for r in ds["input_ids"]],
            [list(m) for m in ds["loss_mask"]],
            list(ds["prompt_length"]),
        )
    return Rows(ids, masks, prompt_lengths, f"generated:{data.data_hash[:12]}")


def fixed_rows(path: str, tokenizer, max_length: int) -> Rows:
    """Fixed text cut into windows of `max_length` tokens; every token trained but the first."""
    from draftsmith.distill.sources import load_source

    source = load_source(path)
    if source.format != "prompt":
        raise RecipeError(f'fixed_data {path!r} holds {source.format} conversations; give text rows ({{"text": ...}})')
    ids, masks = [], []
    for record in source.records:
        tokens = tokenizer(record.prompt).input_ids
        for start in range(0, max(1, len(tokens) - 1), max_length):
            window = tokens[start : start + max_length]
            if len(window) >= 2:
                ids.append(window)
                masks.append([0] + [1] * (len(window) - 1))
    if not ids:
        raise RecipeError(f"fixed_data {path!r} has no text of 2 or more tokens")
    return Rows(ids, masks, [min(32, len(w) // 2) for w in ids], f"fixed:{source.fingerprint[:12]}")


def collate(rows: Rows, index: list[int], max_length: int, pad_id: int) -> dict:
    width = min(max_length, max(len(rows.ids[i]) for i in index))
    ids = torch.full((len(index), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(index), width), dtype=torch.long)
    mask = torch.zeros((len(index), width), dtype=torch.bool)
    for r, i in enumerate(index):
        n = min(width, len(rows.ids[i]))
        ids[r, :n] = torch.tensor(rows.ids[i][:n])
        attention[r, :n] = 1
        mask[r, :n] = torch.tensor(rows.masks[i][:n], dtype=torch.bool)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": mask}


@torch.no_grad()
def on_policy_batch(draft, rows: Rows, index: list[int], recipe, pad_id: int, eos_ids, device) -> dict:
    """(`recipe`: a `DraftRecipe`) The draft continues each row's prompt by sampling at the serving temperature; the loss
    then covers exactly the tokens the draft produced (what it will propose when serving)."""
    from transformers import GenerationConfig

    prompts = [
        rows.ids[i][: max(1, min(rows.prompt_lengths[i], recipe.max_length - recipe.on_policy_new_tokens))]
        for i in index
    ]
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding for generation
        ids[r, width - len(p) :] = torch.tensor(p)
        attention[r, width - len(p) :] = 1
    config = GenerationConfig(
        max_new_tokens=recipe.on_policy_new_tokens,
        do_sample=True,
        temperature=recipe.temperature,
        top_k=None,
        top_p=None,
        eos_token_id=eos_ids or None,
        pad_token_id=pad_id,
    )
    was_training = draft.training
    draft.eval()
    out = draft.generate(input_ids=ids.to(device), attention_mask=attention.to(device), generation_config=config).cpu()
    draft.train(was_training)
    new = out[:, width:]
    samples = []
    for r, p in enumerate(prompts):
        answer = new[r].tolist()
        stop = next((j for j, t in enumerate(answer) if t in set(eos_ids)), None)
        samples.append(p + answer[: stop + 1 if stop is not None else len(answer)])
    batch_rows_ = Rows(
        samples,
        [[0] * len(p) + [1] * (len(s) - len(p)) for p, s in zip(prompts, samples)],
        [len(p) for p in prompts],
        "on-policy",
    )
    return collate(batch_rows_, list(range(len(samples))), recipe.max_length, pad_id) | {
        "generated_tokens": sum(len(s) - len(p) for p, s in zip(prompts, samples))
    }


def is_on_policy_step(step: int, fraction: float) -> bool:
    """Spread the on-policy steps evenly: step s is on-policy when floor((s+1) f) > floor(s f)."""
    return math.floor((step + 1) * fraction + 1e-9) > math.floor(step * fraction + 1e-9)
