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
    hidden = target(torch.tensor([context]), output_hidden_states=True).hidden_states
    feats = head.project(torch.cat([hidden[i][:, :n] for i in head.config.aux_layer_ids], -1))
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
    import torch

    from draftsmith.train.dflash import every_block

    _, batch, states = greedy_answers_batch(target)
    feats = torch.cat([states.hidden_states[i] for i in head.config.aux_layer_ids], -1)
    chains, starts, _, _ = every_block(head, batch, feats, states.logits, recipe, None, losses)
    return chains, starts
