"""Draft builders: truncation is the target's early exit, config drafts keep the vocabulary,
checkpoints with another vocabulary are refused."""

from __future__ import annotations

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from draftsmith.heads.draft import (
    DraftBuildError,
    check_same_vocabulary,
    describe_draft,
    draft_by_truncation,
    draft_from_config,
    load_draft,
)
from draftsmith.heads.models import ModelLoadError, target_fingerprint
from draftsmith.heads.toy import FAMILIES, VOCAB, tiny_config, tiny_model, tiny_tokenizer

LAYERS = 4


@pytest.fixture(scope="module")
def targets():
    """`targets(family)` -> a 4-layer tiny target, built once; tests only read it."""
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = tiny_model(family, layers=LAYERS)
        return cache[family]

    return get


def ids(n=12, seed=0):
    return torch.randint(3, VOCAB, (2, n), generator=torch.Generator().manual_seed(seed))


def target_final_norm(model):
    base = model.base_model
    return base.norm if hasattr(base, "norm") else base.final_layer_norm


def permuted_tokenizer():
    """The toy tokenizer with two ordinary tokens' ids swapped: same size, other token strings."""
    data = json.loads(tiny_tokenizer().backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    a, b = [tok for tok, i in vocab.items() if i in (100, 200)]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(data)), pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


# --------------------------------------------------------------------------- truncation


@pytest.mark.parametrize("family", FAMILIES)
def test_truncation_is_the_targets_early_exit(targets, family):
    target = targets(family)
    x = ids()
    with torch.no_grad():
        hidden = target(x, output_hidden_states=True).hidden_states
        for k in (1, 3):
            draft = draft_by_truncation(target, k)
            expected = target.get_output_embeddings()(target_final_norm(target)(hidden[k]))
            torch.testing.assert_close(draft(x).logits, expected, rtol=1e-5, atol=1e-5)
            assert set(dict(draft.named_parameters())) <= set(dict(target.named_parameters()))
            assert draft.config.num_hidden_layers == k
            assert len(getattr(draft.config, "layer_types", None) or [None] * k) == k  # qwen2 cuts its list
            assert draft.config.draftsmith_build["method"] == "truncation"
            assert draft.config.draftsmith_build["target_fingerprint"] == target_fingerprint(target)
    # the draft owns copies: training it leaves the target alone
    assert draft.get_input_embeddings().weight.data_ptr() != target.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("num_layers", [0, LAYERS, LAYERS + 1])
def test_truncation_needs_fewer_layers(targets, num_layers):
    with pytest.raises(DraftBuildError, match=rf"1 <= num_layers < {LAYERS}, got {num_layers}"):
        draft_by_truncation(targets("llama"), num_layers)


# --------------------------------------------------------------------------- from config


@pytest.mark.parametrize("family", FAMILIES)
def test_config_draft_keeps_family_and_vocabulary(targets, family):
    target = targets(family)
    draft = draft_from_config(target, num_layers=1)
    assert type(draft.config) is type(target.config) and type(draft) is type(target)
    assert draft.config.vocab_size == target.config.vocab_size
    assert draft.config.num_hidden_layers == 1
    assert draft.generation_config.to_dict() == target.generation_config.to_dict()
    for copied in (lambda m: m.get_input_embeddings().weight, lambda m: m.get_output_embeddings().weight):
        torch.testing.assert_close(copied(draft), copied(target), rtol=0, atol=0)
    torch.testing.assert_close(target_final_norm(draft).weight, target_final_norm(target).weight, rtol=0, atol=0)
    check_same_vocabulary(target, draft, tiny_tokenizer(), tiny_tokenizer())
    assert draft(ids()).logits.shape == (2, 12, VOCAB)

    narrow = draft_from_config(target, num_layers=2, hidden_size=32)
    assert narrow.config.hidden_size == 32 and narrow.config.intermediate_size == 64  # the target's 2x ratio
    assert narrow.get_input_embeddings().weight.shape == (VOCAB, 32)
    assert narrow.config.draftsmith_build["copied_embeddings"] is False
    assert narrow(ids()).logits.shape == (2, 12, VOCAB)
    info = describe_draft(narrow, target)
    assert info["method"] == "config" and info["num_layers"] == 2 and info["hidden_size"] == 32
    assert 0 < info["share_of_target"] < 1 and info["built_from_this_target"] is True


def test_config_draft_is_seeded_and_embeddings_optional(targets):
    target = targets("llama")
    a = draft_from_config(target, num_layers=2, seed=3, copy_embeddings=False)
    b = draft_from_config(target, num_layers=2, seed=3, copy_embeddings=False)
    torch.testing.assert_close(a.get_input_embeddings().weight, b.get_input_embeddings().weight, rtol=0, atol=0)
    assert not torch.equal(a.get_input_embeddings().weight, target.get_input_embeddings().weight)
    c = draft_from_config(target, num_layers=2, num_attention_heads=6, num_key_value_heads=3)
    assert (c.config.num_attention_heads, c.config.num_key_value_heads, c.config.head_dim) == (6, 3, 8)
    assert c(ids()).logits.shape == (2, 12, VOCAB)


@pytest.mark.parametrize(
    ("family", "kwargs", "message"),
    [
        ("llama", dict(num_layers=0), "num_layers=0"),
        ("llama", dict(num_layers=2, hidden_size=50), "hidden_size=50 is not divisible by num_attention_heads=4"),
        (
            "llama",
            dict(num_layers=2, num_attention_heads=5),
            "hidden_size=48 is not divisible by num_attention_heads=5",
        ),
        (
            "qwen2",
            dict(num_layers=2, num_attention_heads=6, num_key_value_heads=4),
            "heads=6 is not divisible by num_key_value_heads=4",
        ),
        (
            "llama",
            dict(num_layers=2, hidden_size=36, num_attention_heads=3),
            "heads=3 is not divisible by num_key_value_heads=2",
        ),
        (
            "mistral",
            dict(num_layers=2, num_key_value_heads=3),
            "num_attention_heads=4 is not divisible by num_key_value_heads=3",
        ),
        ("gpt_neox", dict(num_layers=2, num_key_value_heads=2), "GPTNeoXConfig\\) has no `num_key_value_heads`"),
        ("qwen2", dict(num_layers=LAYERS + 1), "layer_types"),
    ],
)
def test_config_draft_bad_shapes(targets, family, kwargs, message):
    with pytest.raises(DraftBuildError, match=message):
        draft_from_config(targets(family), **kwargs)


def test_build_record_survives_save_pretrained(targets, tmp_path):
    target = targets("qwen2")
    draft = draft_from_config(target, num_layers=2, hidden_size=32, seed=1)
    draft.save_pretrained(tmp_path / "draft")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "draft")
    assert loaded.config.draftsmith_build == draft.config.draftsmith_build
    assert loaded.config.layer_types == ["full_attention"] * 2
    torch.testing.assert_close(loaded(ids()).logits, draft(ids()).logits)


# --------------------------------------------------------------------------- checkpoints


def save_draft(model, folder, tokenizer):
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_load_compatible_draft(targets, tmp_path):
    target = targets("llama")
    folder = save_draft(draft_by_truncation(target, 2), tmp_path / "draft", tiny_tokenizer())
    draft = load_draft(folder, target, target_tokenizer=tiny_tokenizer())
    build = draft.config.draftsmith_build
    assert build["method"] == "checkpoint" and build["path"] == str(folder)
    assert build["source_build"]["method"] == "truncation"
    assert draft.dtype == target.dtype and draft.device == target.device
    assert draft.generation_config.to_dict() == target.generation_config.to_dict()
    assert describe_draft(draft, target)["method"] == "checkpoint"


def test_load_draft_with_other_vocabulary_size(targets, tmp_path):
    config = tiny_config("llama")
    config.vocab_size = VOCAB + 64
    # Same tokenizer, logits padded differently (as Qwen2.5 0.5B vs 7B): resized to the target's size.
    padded = save_draft(AutoModelForCausalLM.from_config(config), tmp_path / "padded", tiny_tokenizer())
    draft = load_draft(padded, targets("llama"), target_tokenizer=tiny_tokenizer())
    assert draft.get_output_embeddings().weight.shape[0] == VOCAB
    assert draft.config.draftsmith_build["resized_vocab_from"] == VOCAB + 64
    # No tokenizer to prove the ids agree: a size mismatch is an error.
    bare = tmp_path / "bare"
    AutoModelForCausalLM.from_config(config).save_pretrained(bare)
    with pytest.raises(DraftBuildError, match=rf"outputs {VOCAB + 64} logits, .* outputs {VOCAB}.*target's tokenizer"):
        load_draft(bare, targets("llama"), target_tokenizer=tiny_tokenizer())


def test_load_draft_with_other_tokenizer(targets, tmp_path):
    folder = save_draft(tiny_model("llama"), tmp_path / "permuted", permuted_tokenizer())
    with pytest.raises(DraftBuildError, match=r"different tokenizer.*2 ids map to other tokens.*id 100") as err:
        load_draft(folder, targets("llama"), target_tokenizer=tiny_tokenizer())
    assert str(folder) in str(err.value) and "speculative decoding needs the target's tokenizer" in str(err.value)
    assert isinstance(err.value, ModelLoadError)


def test_load_draft_missing_folder(targets, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_draft(tmp_path / "nowhere", targets("llama"))


# --------------------------------------------------------------------------- in memory


def test_check_same_vocabulary_in_memory(targets):
    target = targets("mistral")
    other_family = tiny_model("gpt_neox")  # any family will do, as long as the vocabulary is the target's
    check_same_vocabulary(target, other_family)
    check_same_vocabulary(target, other_family, tiny_tokenizer(), tiny_tokenizer())
    check_same_vocabulary(target, other_family, tiny_tokenizer(), None)  # nothing to compare strings with
    with pytest.raises(DraftBuildError, match="different tokenizer"):
        check_same_vocabulary(target, other_family, tiny_tokenizer(), permuted_tokenizer())
    resized = tiny_model("mistral")
    resized.resize_token_embeddings(VOCAB + 8)
    with pytest.raises(DraftBuildError, match=rf"outputs {VOCAB + 8} logits"):
        check_same_vocabulary(target, resized)
