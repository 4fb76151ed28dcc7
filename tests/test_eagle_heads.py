"""EAGLE heads: shapes, frozen target copies, vocabulary maps, the draft cache, exports, checks."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import tiny_model
from safetensors.torch import load_file
from transformers import DynamicCache, LlamaConfig

from draftsmith.distill.vocab import build_vocab_map
from draftsmith.heads import eagle
from draftsmith.heads.eagle import (
    SGLANG_KEYS,
    VLLM_KEYS,
    EagleError,
    EagleHead,
    default_aux_layer_ids,
    export_eagle,
    load_eagle,
    save_eagle,
)

H, V, VD, L, I = 48, 320, 64, 4, 96  # toy hidden, vocab, draft vocab, target layers, intermediate
HEADS, KV, HD = 4, 2, 12


@pytest.fixture(scope="module")
def targets():
    cache = {}

    def get(family: str = "llama", **kwargs):
        key = (family, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = tiny_model(family, layers=L, **kwargs)
        return cache[key]

    return get


def vocab_map(data_hash: str = "data-1234567890ab"):
    counts = torch.arange(V).flip(0) * (torch.arange(V) % 3 != 0)  # every third id never seen: a gappy map
    return build_vocab_map(counts, VD, data_hash)


def trained(head: EagleHead, seed: int = 1) -> EagleHead:
    """Move every trainable parameter off its init, so that round trips compare something."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return head.eval()


def make(target, version="eagle3", reduced=True, **kwargs) -> EagleHead:
    vmap = vocab_map() if (reduced and version == "eagle3") else None
    return EagleHead.for_target(
        target, version, vocab_map=vmap, target_name_or_path="toy/target", data_hash="d" * 8, **kwargs
    )


def inputs(head: EagleHead, T: int = 6, B: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, T), generator=gen)
    width = head.config.num_aux * H if head.config.version == "eagle3" else H
    hidden = head.project(torch.randn(B, T, width, generator=gen))
    return ids, hidden, torch.arange(T).expand(B, T)


# ---------------------------------------------------------------------- shapes and parameters
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_shapes_parameter_counts_and_exactly_the_trainable_parameters(targets, family, version):
    target = targets(family)
    head = make(target, version)
    c = head.config
    assert (c.max_position_embeddings, c.rope_parameters) == (
        target.config.max_position_embeddings,
        target.config.rope_parameters,
    )
    attn_in = 2 * H if version == "eagle3" else H
    attention = attn_in * (HEADS + 2 * KV) * HD + HEADS * HD * H
    mlp = 3 * H * I
    if version == "eagle3":
        assert c.aux_layer_ids == [1, 2, 3] and c.draft_vocab_size == VD
        trainable = 3 * H * H + attention + mlp + 4 * H + VD * H  # fc, layer, 3 layer norms + norm, lm_head
        frozen = V * H  # embed_tokens
    else:
        assert c.aux_layer_ids == [L] and c.draft_vocab_size == V
        trainable = 2 * H * H + H + attention + mlp + H  # fc (bias), layer, post_attention_layernorm only
        frozen = 2 * V * H  # embed_tokens, lm_head
    params = dict(head.named_parameters())
    assert sum(p.numel() for p in params.values() if p.requires_grad) == trainable
    assert sum(p.numel() for p in params.values() if not p.requires_grad) == frozen
    frozen_names = {n for n, p in params.items() if not p.requires_grad}
    assert frozen_names == (
        {"embed_tokens.weight"} if version == "eagle3" else {"embed_tokens.weight", "lm_head.weight"}
    )
    assert ("layers.0.input_layernorm.weight" in params) == (version == "eagle3")  # EAGLE-1 drops it
    torch.testing.assert_close(head.embed_tokens.weight, target.get_input_embeddings().weight, rtol=0, atol=0)

    ids, hidden, pos = inputs(head)
    out, logits = head(ids, hidden, position_ids=pos)
    assert out.shape == (2, 6, H) and logits.shape == (2, 6, c.draft_vocab_size)
    logits.logsumexp(-1).sum().backward()
    assert all((p.grad is None) != p.requires_grad for p in head.parameters())


def test_eagle1_reproduces_the_target_lm_head_on_its_output(targets):
    target = targets()
    head = make(target, "eagle1")
    ids, hidden, pos = inputs(head)
    out, logits = head(ids, hidden, position_ids=pos)
    torch.testing.assert_close(logits, target.lm_head(out), rtol=0, atol=1e-5)


def test_default_aux_layer_ids_rule():
    assert default_aux_layer_ids(32) == [2, 16, 29]  # the paper's (2, L//2, L-3)
    assert default_aux_layer_ids(7) == [2, 3, 4]
    assert default_aux_layer_ids(6) == [1, 3, 5]
    assert default_aux_layer_ids(4) == [1, 2, 3]
    assert default_aux_layer_ids(3) == [0, 1, 2]
    assert default_aux_layer_ids(2) == [0, 1]


# ---------------------------------------------------------------------- vocabulary maps
def test_d2t_t2d_consistency_draft_to_target_and_target_logits(targets):
    target = targets()
    vmap = vocab_map()
    head = make(target)
    ids = torch.arange(VD)
    mapped = head.draft_to_target(ids)
    assert head.t2d[mapped].all() and int(head.t2d.sum()) == VD and mapped.unique().numel() == VD
    torch.testing.assert_close(mapped, vmap.target_ids(), rtol=0, atol=0)
    # lm_head rows are the target's rows of the draft vocabulary
    torch.testing.assert_close(head.lm_head.weight, target.lm_head.weight[mapped], rtol=0, atol=0)

    logits = torch.randn(2, 3, VD)
    full = head.target_logits(logits)
    assert full.shape == (2, 3, V)
    assert torch.isinf(full[..., ~head.t2d]).all() and torch.isfinite(full[..., head.t2d]).all()
    torch.testing.assert_close(full.argmax(-1), head.draft_to_target(logits.argmax(-1)), rtol=0, atol=0)
    torch.testing.assert_close(full[..., mapped], logits, rtol=0, atol=0)

    plain = make(target, reduced=False)  # full vocabulary: d2t zeros, t2d all True, identities
    assert not plain.d2t.any() and plain.t2d.all()
    torch.testing.assert_close(plain.draft_to_target(ids), ids)
    wide = torch.randn(2, V)
    assert plain.target_logits(wide) is wide
    e1 = make(target, "eagle1")
    torch.testing.assert_close(e1.draft_to_target(ids), ids)


# ---------------------------------------------------------------------- the cache
@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_one_forward_equals_token_by_token_through_the_cache(targets, version):
    head = trained(make(targets("mistral"), version))
    ids, hidden, pos = inputs(head, T=6)
    with torch.no_grad():
        full_out, full_logits = head(ids, hidden, position_ids=pos)
        cache = DynamicCache()
        outs, logits = [], []
        for start, end in [(0, 2), (2, 3), (3, 4), (4, 5), (5, 6)]:  # a prefix of 2, then one token at a time
            sl = slice(start, end)
            o, lg = head(ids[:, sl], hidden[:, sl], position_ids=pos[:, sl], cache=cache)
            outs.append(o)
            logits.append(lg)
    assert cache.get_seq_length() == 6
    torch.testing.assert_close(torch.cat(outs, 1), full_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(logits, 1), full_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_logits_at_projects_just_those_positions(targets, version):
    """Training projects only the positions its loss reads: the same logits, row-major, [N, Vd]."""
    head = trained(make(targets(), version))
    ids, hidden, pos = inputs(head, T=6)
    at = torch.tensor([[True, False, False, True, True, False], [False, False, True, False, False, True]])
    with torch.no_grad():
        out, logits = head(ids, hidden, position_ids=pos)
        kept_out, kept = head(ids, hidden, position_ids=pos, logits_at=at)
    assert kept.shape == (int(at.sum()), head.config.draft_vocab_size)
    torch.testing.assert_close(kept_out, out)
    torch.testing.assert_close(kept, logits[at], rtol=1e-5, atol=1e-5)
    with pytest.raises(EagleError, match=r"logits_at \[2, 5\] must be \[B, T\] = \[2, 6\]"):
        head(ids, hidden, position_ids=pos, logits_at=at[:, :5])


def tree_attention_mask(parents: list[int], past_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-Python reference: the float additive mask [1, 1, n, past_len + n] of n tree nodes
    fed after `past_len` cached entries (a node sees the cache, its ancestors and itself;
    `parents[i]` = -1 for a child of the cache's last entry), and each node's depth (0 for
    those children)."""
    n = len(parents)
    sees, depth = [], []
    for i, parent in enumerate(parents):
        assert -1 <= parent < i, "parents come first"
        row = list(sees[parent]) if parent >= 0 else [True] * past_len + [False] * n
        row[past_len + i] = True
        sees.append(row)
        depth.append(depth[parent] + 1 if parent >= 0 else 0)
    allowed = torch.tensor(sees).view(1, 1, n, past_len + n)
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask, torch.tensor(depth)


def test_tree_mask_matches_the_causal_chain_and_keep_compacts_to_it(targets):
    head = trained(make(targets()))
    ids, hidden, pos = inputs(head, T=7, B=1)
    with torch.no_grad():
        # A chain-only tree mask equals the default causal run.
        mask, depth = tree_attention_mask([-1, 0, 1, 2], past_len=0)
        a = head(ids[:, :4], hidden[:, :4], position_ids=pos[:, :4], attention_mask=mask)
        b = head(ids[:, :4], hidden[:, :4], position_ids=pos[:, :4])
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)

        # A prefix of 3 in the cache, then a tree of 4 nodes: 0 <- 1 <- 3 is a chain, 2 a sibling of 0.
        ref_cache, tree_cache = DynamicCache(), DynamicCache()
        for cache in (ref_cache, tree_cache):
            head(ids[:, :3], hidden[:, :3], position_ids=pos[:, :3], cache=cache)
        chain = [3, 4, 6]  # the tokens of nodes 0, 1, 3
        ref = head(ids[:, chain], hidden[:, chain], position_ids=torch.tensor([[3, 4, 5]]), cache=ref_cache)
        parents = [-1, 0, -1, 1]
        mask, depth = tree_attention_mask(parents, past_len=3)
        nodes = [3, 4, 5, 6]
        out = head(ids[:, nodes], hidden[:, nodes], position_ids=3 + depth[None], attention_mask=mask, cache=tree_cache)
    for x, y in zip(out, ref):
        torch.testing.assert_close(x[:, [0, 1, 3]], y, rtol=1e-5, atol=1e-5)
    kept, ref_layer = tree_cache.layers[0], ref_cache.layers[0]  # the prefix, then the path's nodes 0, 1, 3
    path = torch.tensor([0, 1, 2, 3, 4, 6])
    torch.testing.assert_close(kept.keys.index_select(-2, path), ref_layer.keys, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kept.values.index_select(-2, path), ref_layer.values, rtol=1e-5, atol=1e-5)


def test_bad_masks_are_refused(targets):
    head = make(targets())
    ids, hidden, pos = inputs(head, T=3, B=1)
    with pytest.raises(EagleError, match="float additive"):
        head(ids, hidden, position_ids=pos, attention_mask=torch.ones(1, 1, 3, 3, dtype=torch.bool))
    with pytest.raises(EagleError, match=r"\[B, 1, 3, 3\]"):
        head(ids, hidden, position_ids=pos, attention_mask=torch.zeros(1, 1, 3, 4))


# ---------------------------------------------------------------------- exports
def outputs(head: EagleHead):
    ids, hidden, pos = inputs(head, seed=3)
    with torch.no_grad():
        return head(ids, hidden, position_ids=pos)


@pytest.mark.parametrize("reduced", [True, False], ids=["reduced", "full"])
def test_vllm_export_keys_config_and_round_trip(targets, tmp_path, reduced):
    target = targets("qwen2")
    head = trained(make(target, reduced=reduced))
    out = export_eagle(head, tmp_path / "vllm", "vllm", num_speculative_tokens=5)
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == set(VLLM_KEYS) | ({"d2t", "t2d"} if reduced else set())
    cfg = json.loads((out / "config.json").read_text())
    for field in (
        "speculators_model_type",
        "speculators_version",
        "draft_vocab_size",
        "eagle_aux_hidden_state_layer_ids",
        "norm_before_residual",
        "norm_before_fc",
        "norm_output",
        "fc_norm",
        "embed_requires_grad",
        "target_hidden_size",
        "tie_word_embeddings",
        "transformer_layer_config",
        "speculators_config",
    ):
        assert field in cfg, field
    assert cfg["architectures"] == ["Eagle3DraftModel"] and cfg["speculators_model_type"] == "eagle3"
    assert cfg["norm_before_residual"] is False and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == (VD if reduced else V)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    tlc = cfg["transformer_layer_config"]
    assert tlc["num_hidden_layers"] == 1 and tlc["head_dim"] == HD and tlc["vocab_size"] == V
    assert tlc["max_position_embeddings"] == target.config.max_position_embeddings
    assert tlc["rope_parameters"] == target.config.rope_parameters
    assert tlc["rope_theta"] == target.config.rope_parameters["rope_theta"]
    parsed = LlamaConfig(**tlc)  # what a server builds from it
    assert parsed.rope_parameters == target.config.rope_parameters and parsed.max_position_embeddings == 512
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0] == {
        **spec["proposal_methods"][0],
        "proposal_type": "greedy",
        "speculative_tokens": 5,
    }
    assert spec["verifier"] == {"name_or_path": "toy/target", "architectures": ["Qwen2ForCausalLM"]}

    back = load_eagle(out, target=target, expected_data_hash="data-1234567890ab")
    for a, b in zip(outputs(back), outputs(head)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert back.config.aux_layer_ids == head.config.aux_layer_ids
    assert back.config.vocab_map_data_hash == head.config.vocab_map_data_hash
    assert {n for n, p in back.named_parameters() if not p.requires_grad} == {"embed_tokens.weight"}


def test_sglang_export_keys_config_and_round_trip(targets, tmp_path):
    target = targets()
    head = trained(make(target))
    out = export_eagle(head, tmp_path / "sglang", "sglang")
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == set(SGLANG_KEYS) | {"d2t", "t2d"}
    assert "midlayer.hidden_norm.weight" in keys and "midlayer.self_attn.q_proj.weight" in keys
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == VD and cfg["vocab_size"] == V
    assert cfg["max_position_embeddings"] == target.config.max_position_embeddings
    assert cfg["rope_parameters"] == target.config.rope_parameters
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # SGLang adds 1 back
    back = load_eagle(out, target=target)
    assert back.config.aux_layer_ids == [1, 2, 3]
    for a, b in zip(outputs(back), outputs(head)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
@pytest.mark.parametrize("fault", ["missing", "left_over"])
def test_a_missing_or_left_over_key_refuses_to_export(targets, tmp_path, monkeypatch, fmt, fault):
    head = make(targets())
    real = eagle.formats._export_state

    def broken(h, f):
        state = real(h, f)
        if fault == "missing":
            state.pop("norm.weight")
        else:
            state["layers.0.rotary_emb.inv_freq"] = torch.zeros(6)
        return state

    monkeypatch.setattr(eagle.formats, "_export_state", broken)
    with pytest.raises(EagleError, match="norm.weight" if fault == "missing" else "rotary_emb"):
        export_eagle(head, tmp_path / "out", fmt)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


def test_hf_save_round_trip_and_eagle1_exports(targets, tmp_path):
    target = targets()
    e1 = trained(make(target, "eagle1"))
    with pytest.raises(EagleError, match="only EAGLE-3.*'hf'"):
        export_eagle(e1, tmp_path / "e1-vllm", "vllm")
    with pytest.raises(EagleError, match="only EAGLE-3"):
        export_eagle(e1, tmp_path / "e1-sglang", "sglang")
    out = export_eagle(e1, tmp_path / "e1", "hf")
    back = load_eagle(out, target=target)
    assert back.config.version == "eagle1" and back.config.aux_layer_ids == [L]
    assert {n for n, p in back.named_parameters() if not p.requires_grad} == {"embed_tokens.weight", "lm_head.weight"}
    for a, b in zip(outputs(back), outputs(e1)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)

    e3 = trained(make(target))
    out = save_eagle(e3, tmp_path / "e3")
    save_eagle(e3, tmp_path / "e3")  # re-saving over a draftsmith EAGLE head is allowed
    back = load_eagle(out, expected_data_hash="data-1234567890ab")
    torch.testing.assert_close(back.d2t, e3.d2t, rtol=0, atol=0)
    for a, b in zip(outputs(back), outputs(e3)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(EagleError, match="not empty"):
        save_eagle(e3, tmp_path / "other")
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_attention_bias_travels_to_vllm_and_is_refused_by_sglang(tmp_path):
    target = tiny_model("llama", layers=L)
    target.config.attention_bias = True  # the head copies the flag (its own layer is built from it)
    head = trained(make(target))
    out = export_eagle(head, tmp_path / "vllm", "vllm")
    keys = set(load_file(str(out / "model.safetensors")))
    assert {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"} <= keys
    for a, b in zip(outputs(load_eagle(out)), outputs(head)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(EagleError, match="attention bias"):
        export_eagle(head, tmp_path / "sglang", "sglang")


def test_bf16_keeps_rope_frequencies_in_fp32(targets):
    head = make(targets()).to(torch.bfloat16)
    assert head.lm_head.weight.dtype == torch.bfloat16 and head.rotary_emb.inv_freq.dtype == torch.float32
    ids, hidden, pos = inputs(head)
    out, logits = head(ids, hidden, position_ids=pos)
    assert out.dtype == logits.dtype == torch.bfloat16


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize("bad", [-1, L + 1])
def test_aux_layer_id_out_of_range(targets, bad):
    with pytest.raises(EagleError, match=rf"aux layer id {bad} .*0\.\.{L}"):
        make(targets(), aux_layer_ids=[1, bad, 3])


def test_post_norm_aux_id_is_not_exportable(targets, tmp_path):
    head = make(targets(), aux_layer_ids=[1, 2, L])
    with pytest.raises(EagleError, match="post-norm"):
        export_eagle(head, tmp_path / "x", "vllm")


def test_wrong_expected_data_hash(targets, tmp_path):
    out = save_eagle(make(targets()), tmp_path / "e3")
    with pytest.raises(EagleError, match="vocab-map"):
        load_eagle(out, expected_data_hash="other-data-hash0")


def test_check_target_refuses_another_shape(targets):
    head = make(targets())
    with pytest.raises(EagleError, match="hidden size 48.*64"):
        head.check_target(targets(hidden=64))
    other = tiny_model("llama", layers=L)
    other.config.max_position_embeddings = 4096
    with pytest.raises(EagleError, match="max_position_embeddings"):
        head.check_target(other)
    other = tiny_model("llama", layers=L + 1)
    with pytest.raises(EagleError, match="num_hidden_layers"):
        head.check_target(other)


def test_unknown_format_and_bad_folders(targets, tmp_path):
    head = make(targets())
    with pytest.raises(EagleError, match="'onnx'"):
        export_eagle(head, tmp_path / "x", "onnx")
    with pytest.raises(EagleError, match="does not exist"):
        load_eagle(tmp_path / "nowhere")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(EagleError, match="not an EAGLE head config"):
        load_eagle(tmp_path / "junk")


# ---------------------------------------------------------------------- EAGLE-3 variants (speculators' flags)
def test_variant_parameters_and_what_trains(targets):
    target = targets()
    plain = make(target)
    n_plain = sum(p.numel() for p in plain.parameters() if p.requires_grad)
    e31 = make(target, fc_norm=True, norm_output=True)
    assert [n for n, _ in e31.named_parameters() if n.startswith("fc_norm")] == [
        f"fc_norm.{i}.weight" for i in range(3)
    ]
    assert sum(p.numel() for p in e31.parameters() if p.requires_grad) == n_plain + 3 * H
    gpt_oss = make(target, norm_before_fc=True, embed_requires_grad=True)
    assert tuple(gpt_oss.input_norm.weight.shape) == (3 * H,) and gpt_oss.embed_tokens.weight.requires_grad
    assert sum(p.numel() for p in gpt_oss.parameters() if p.requires_grad) == n_plain + 3 * H + V * H
    with pytest.raises(EagleError, match="exclusive"):
        make(target, norm_before_fc=True, fc_norm=True)
    with pytest.raises(EagleError, match="EAGLE-3 options"):
        make(target, "eagle1", norm_output=True)
    with pytest.raises(EagleError, match="unknown option.*fc_norms"):
        make(target, fc_norms=True)
    with pytest.raises(EagleError, match="fc_norm='yes'; expected true or false"):
        eagle.EagleConfig(fc_norm="yes")


def test_variant_forward_is_what_each_flag_means(targets):
    target = targets()
    plain = trained(make(target))
    ids, _, pos = inputs(plain)
    aux = torch.randn(2, 6, 3 * H, generator=torch.Generator().manual_seed(4))
    for flags in ({"fc_norm": True}, {"norm_before_fc": True}, {"norm_output": True}):
        head = make(target, **flags)
        missing, _ = head.load_state_dict(plain.state_dict(), strict=False)
        assert missing == [k for k in head.state_dict() if "norm" in k and k not in plain.state_dict()]
        with torch.no_grad():
            for name, p in head.named_parameters():  # the new norms' gains off 1 as well
                if name.startswith(("fc_norm", "input_norm")):
                    p.mul_(1.0 + 0.5 * torch.arange(p.shape[0]) / p.shape[0])
            feature = head.project(aux)
            if "fc_norm" in flags:  # one RMSNorm per aux state, then the concat
                parts = [norm(part) for norm, part in zip(head.fc_norm, aux.chunk(3, dim=-1))]
                torch.testing.assert_close(feature, head.fc(torch.cat(parts, -1)))
            elif "norm_before_fc" in flags:
                torch.testing.assert_close(feature, head.fc(head.input_norm(aux)))
            out, logits = head(ids, feature, position_ids=pos)
            head.config.norm_output = False  # the same weights without the flag
            raw, plain_logits = head(ids, feature, position_ids=pos)
        torch.testing.assert_close(logits, plain_logits, rtol=0, atol=0)  # the logits never change
        torch.testing.assert_close(out, head.norm(raw) if "norm_output" in flags else raw, rtol=0, atol=0)


def test_eagle31_vllm_export_round_trip_and_sglang_refusal(targets, tmp_path):
    target = targets()
    head = trained(make(target, fc_norm=True, norm_output=True, embed_requires_grad=True))
    out = export_eagle(head, tmp_path / "vllm", "vllm")
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == set(VLLM_KEYS) | {"d2t", "t2d"} | {f"fc_norm.{i}.weight" for i in range(3)}
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["fc_norm"], cfg["norm_output"], cfg["embed_requires_grad"], cfg["norm_before_fc"]) == (
        True,
        True,
        True,
        False,
    )
    back = load_eagle(out, target=target)
    assert (back.config.fc_norm, back.config.norm_output) == (True, True) and back.embed_tokens.weight.requires_grad
    for a, b in zip(outputs(back), outputs(head)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(EagleError, match="fc_norm/norm_output.*--format vllm"):
        export_eagle(head, tmp_path / "sglang", "sglang")
    gpt_oss = trained(make(target, norm_before_fc=True))
    out = export_eagle(gpt_oss, tmp_path / "gpt-oss", "vllm")
    assert "input_norm.weight" in load_file(str(out / "model.safetensors"))
    for a, b in zip(outputs(load_eagle(out)), outputs(gpt_oss)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_draft_narrower_than_its_target(targets, tmp_path):
    target = targets()
    layer = make(target).config.to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        layer.pop(key, None)
    config = eagle.EagleConfig(
        **{**layer, "hidden_size": 32, "head_dim": 8, "target_hidden_size": H, "draft_vocab_size": V}
    )
    head = trained(EagleHead(config))
    assert tuple(head.fc.weight.shape) == (32, 3 * H) and tuple(head.embed_tokens.weight.shape) == (V, 32)
    head.check_target(target)  # fc reads the target's width: the hidden sizes that must match do
    back = load_eagle(export_eagle(head, tmp_path / "vllm", "vllm"))
    assert back.config.target_hidden_size == H
    ids, _, pos = inputs(head)
    feature = torch.randn(2, 6, 3 * H)
    with torch.no_grad():
        for a, b in zip(
            back(ids, back.project(feature), position_ids=pos), head(ids, head.project(feature), position_ids=pos)
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize(
    "edit, named",
    [
        ({"fc_norm": "yes"}, "fc_norm='yes'"),
        ({"fc_norm": True, "norm_before_fc": True}, "exclusive"),
        ({"transformer_layer_config": {"num_hidden_layers": 2}}, "2 decoder layers"),
        ({"target_hidden_size": 0}, "target_hidden_size=0"),
    ],
)
def test_bad_speculators_configs_name_the_flag(targets, tmp_path, edit, named):
    out = export_eagle(make(targets()), tmp_path / "vllm", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    for key, value in edit.items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EagleError, match=named):
        load_eagle(out)


def test_a_sliding_window_draft_loads_with_a_warning(targets, tmp_path):
    head = trained(make(targets()))
    out = export_eagle(head, tmp_path / "vllm", "vllm")
    cfg = json.loads((out / "config.json").read_text())
    cfg["transformer_layer_config"].update(
        layer_types=["sliding_attention"], sliding_window=2048
    )  # speculators' default
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="sliding-window attention over 2048 tokens"):
        back = load_eagle(out)
    for a, b in zip(outputs(back), outputs(head)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
