"""DFlash2 heads: the block backbone with grouped dynamic causal convolutions around each sublayer
and a candidate selector that walks a chain through each slot's top candidates (docs/dflash2.md).

    head = DFlash2Head.for_target(target, block_size=8, mask_token_id=mid)       # full vocabulary only
    h = head.hidden(block_ids, ctx, positions=pos, attention_mask=mask)          # [N, Q, H], one backbone pass
    unary = head.lm_head(h[:, k])                                                # [N, V] slot k's logits U
    candidates, scores = head.walk_step(unary, h[:, k], prev_ids)                # [N, K] each, after x_{k-1}
    save_dflash2(head, "out/dflash2")                                            # draftsmith.heads.dflash2_formats
    head = load_dflash2("out/dflash2", target=target)

What it adds to `BlockHead` (speculators 0.9.0's `dflash2` model type, `DFlash2DraftModel`, adapted
there from z-lab's release; slots as the backbone's, `sample_from_anchor: false`: the block [anchor, mask, ...]
at positions p..p+B-1 drafts B - 1 tokens, slot k >= 1 the token at p + k):
- the convolutions: in every draft layer, each sublayer (attention, MLP) is wrapped as
      a = conv_in(x), y = sublayer(a), out = conv_out(y)
  where conv(x)_k = sum_{t < kernel, t <= k} x_{k-t} * (base[t] + delta_k[t, group(c)]) runs over the
  slots of one block (slot k reads slots k, k-1, ..., never a later one, never another block's):
  `base` [2, kernel, H] is a per-channel kernel per side, delta_k [2, kernel, H / group] a dynamic
  kernel per group of `conv_group_size` channels, projected from the sublayer's (normed) input at
  slot k by `kernel_projection` [H -> 2 kernel H/group]. Init: base[:, 0] = 1, the rest and the
  projection 0, so conv is the identity and a new head computes exactly its block backbone;
- the candidate selector: slot k's candidates are the `selector_top_k` largest of its backbone logits
  U_k (the target's lm_head of the final-norm state h_k); candidate c after the token p is scored
      s(c | p, h_k) = U_k(c) + <A[p] * (W h_k), B[c]>          A, B [V, rank], W [H -> rank]
  (`predecessor_codebook`, `successor_codebook`, `hidden_projection`). The walk starts at the anchor:
  x_k = the candidate the scores choose after p = x_{k-1} (greedy: the argmax; sampling: a draw from
  the law of the scores over the candidates, zero elsewhere), so each draft's law depends on the draft
  before it and decoding/dflash2.py reports exactly that law.
Weights as speculators names them: `layers.{i}.attention_conv.{base_kernel, kernel_projection.weight}`,
`layers.{i}.mlp_conv.*`, `candidate_selector.{predecessor_codebook, successor_codebook,
hidden_projection.weight}`. Full vocabulary only (speculators refuses a reduced one): the embeddings and
the lm_head are the target's, frozen and never saved.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.heads.blocks import BlockConfig, BlockDecoderLayer, BlockError, BlockHead
from draftsmith.heads.layers import describe_mask_head


class DFlash2Error(BlockError):
    """A DFlash2 head that cannot be built, loaded or used; the message says why."""


class DFlash2Config(BlockConfig):
    model_type = "draftsmith_dflash2"

    def __init__(
        self,
        conv_kernel_size: int = 2,  # causal taps per convolution (speculators' and z-lab's default)
        conv_group_size: int = 16,  # channels sharing one dynamic kernel coefficient
        selector_rank: int = 256,  # rank of A[p] * W h and B[c]
        selector_top_k: int = 16,  # candidates per slot taken from the backbone's logits
        **kwargs,
    ):
        for name, value in (
            ("conv_kernel_size", conv_kernel_size),
            ("conv_group_size", conv_group_size),
            ("selector_rank", selector_rank),
            ("selector_top_k", selector_top_k),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise DFlash2Error(f"DFlash2Config: {name}={value!r}; expected an integer >= 1")
        self.conv_kernel_size = conv_kernel_size
        self.conv_group_size = conv_group_size
        self.selector_rank = selector_rank
        self.selector_top_k = selector_top_k
        super().__init__(**kwargs)
        if self.reduced_vocab:
            raise DFlash2Error(
                f"DFlash2Config: draft_vocab_size={self.draft_vocab_size} of vocab_size={self.vocab_size}; DFlash2 "
                "drafts over the target's full vocabulary (speculators' DFlash2DraftModel refuses a reduced one): "
                "leave draft_vocab_size and vocab_map unset"
            )
        if self.hidden_size % conv_group_size:
            raise DFlash2Error(
                f"DFlash2Config: conv_group_size={conv_group_size} does not divide hidden_size={self.hidden_size}"
            )
        if conv_kernel_size > self.block_size:
            raise DFlash2Error(
                f"DFlash2Config: conv_kernel_size={conv_kernel_size} exceeds block_size={self.block_size} "
                "(a convolution reads only its own block's slots)"
            )
        if selector_top_k > self.vocab_size:
            raise DFlash2Error(
                f"DFlash2Config: selector_top_k={selector_top_k} exceeds the vocabulary ({self.vocab_size})"
            )

    # sample_from_anchor stays the backbone's False: slot 0 is the anchor, block_size - 1 drafts per block


# ---------------------------------------------------------------------- the convolutions
def grouped_dynamic_conv(
    x: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, *, block_size: int, group_size: int
) -> torch.Tensor:
    """The causal convolution over each block's slots: out_k = sum_{t < K, t <= k} x_{k-t} *
    (base[t] + delta_k[t, group]). x [N, Q, H] (Q a multiple of block_size: whole blocks, packed),
    delta [N, Q, K, H / group_size] (slot k's own dynamic kernel), base [K, H]."""
    N, Q, H = x.shape
    K, G = base.shape[0], H // group_size
    if Q % block_size or tuple(delta.shape) != (N, Q, K, G) or base.shape[1] != H:
        raise DFlash2Error(
            f"convolution: x {list(x.shape)} must hold whole blocks of {block_size} slots, with delta "
            f"{list(delta.shape)} = [{N}, {Q}, {K}, {G}] and base {list(base.shape)} = [{K}, {H}]"
        )
    blocks = x.view(N, Q // block_size, block_size, G, group_size)  # [N, A, Bs, G, gs]
    delta = delta.view(N, Q // block_size, block_size, K, G)  # [N, A, Bs, K, G]
    out = torch.zeros_like(blocks)
    for t in range(K):
        # slot k reads slot k - t of its own block; the first t slots have nothing there (zeros)
        shifted = F.pad(blocks[:, :, : block_size - t], (0, 0, 0, 0, t, 0))  # [N, A, Bs, G, gs]
        coefficient = base[t].to(x.dtype).view(G, group_size) + delta[:, :, :, t, :, None]  # [N, A, Bs, G, gs]
        out = out + shifted * coefficient
    return out.view(N, Q, H)


class GroupedDynamicCausalConv(nn.Module):
    """The input- and output-side convolutions of one sublayer, both kernels projected from its input."""

    def __init__(self, hidden_size: int, *, block_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.block_size, self.kernel_size, self.group_size = block_size, kernel_size, group_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input/output side, tap, H]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity on both sides: tap 0 weighs 1, every other tap and the dynamic part 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0].fill_(1.0)
            self.kernel_projection.weight.zero_()

    def _conv(self, x, delta, side: int) -> torch.Tensor:
        return grouped_dynamic_conv(
            x, delta, self.base_kernel[side], block_size=self.block_size, group_size=self.group_size
        )

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the convolved sublayer input [N, Q, H], the output side's dynamic kernel [N, Q, K, G])."""
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self._conv(x, kernels[..., 0, :, :], 0), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """The sublayer's output [N, Q, H] convolved with the kernel `prepare` projected from its input."""
        return self._conv(y, delta, 1)


class DFlash2DecoderLayer(nn.Module):
    """A block decoder layer (its attention, MLP and norms, taken over with their weights) with a
    convolution around each sublayer: the parameter names stay the backbone's (`self_attn.*`, ...)."""

    def __init__(self, layer: BlockDecoderLayer, config: DFlash2Config):
        super().__init__()
        self.self_attn, self.mlp = layer.self_attn, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        shape = dict(
            block_size=config.block_size, kernel_size=config.conv_kernel_size, group_size=config.conv_group_size
        )
        self.attention_conv = GroupedDynamicCausalConv(config.hidden_size, **shape)
        self.mlp_conv = GroupedDynamicCausalConv(config.hidden_size, **shape)

    def forward(self, x, context, cos, sin, mask, cache, layer_idx: int) -> torch.Tensor:
        a, delta = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(self.self_attn(a, context, cos, sin, mask, cache, layer_idx), delta)
        m, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), delta)


# ---------------------------------------------------------------------- the candidate selector
class CandidateSelector(nn.Module):
    """Edge scores s(c | p, h) = U(c) + <A[p] * (W h), B[c]> of candidates c after the token p."""

    def __init__(self, config: DFlash2Config):
        super().__init__()
        V, H, r = config.vocab_size, config.hidden_size, config.selector_rank
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(V, r))  # A, indexed by target ids
        self.successor_codebook = nn.Parameter(torch.empty(V, r))  # B
        self.hidden_projection = nn.Linear(H, r, bias=False)  # W
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=config.initializer_range)  # speculators' init

    def context(self, h: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """A[p] * (W h) [..., r] of states h [..., H] after the tokens prev_ids [...]."""
        predecessor = F.embedding(prev_ids.long(), self.predecessor_codebook)  # not [ids]: see `scores`
        return predecessor * self.hidden_projection(h.to(self.hidden_projection.weight.dtype)).to(predecessor.dtype)

    def scores(self, unary: torch.Tensor, h: torch.Tensor, prev_ids: torch.Tensor, candidates: torch.Tensor):
        """s(c | p, h) [..., K] float32 of the candidates [..., K] of slots with logits unary [..., V]
        (of any dtype: only the K candidates' logits are cast)."""
        # F.embedding, not codebook[ids]: indexing's backward accumulates repeated ids with atomic adds
        # on a multi-threaded CPU, in an order that changes from run to run; embedding's does not
        successor = F.embedding(candidates, self.successor_codebook)  # [..., K, r]
        transition = (self.context(h, prev_ids)[..., None, :] * successor).sum(-1)
        return unary.gather(-1, candidates).float() + transition.float()


class DFlash2Head(BlockHead):
    """A DFlash2 block drafter for one target (module docstring)."""

    config_class = DFlash2Config
    base_model_prefix = "dflash2"
    error = DFlash2Error
    title = "DFlash2 head"

    def __init__(self, config: DFlash2Config):
        super().__init__(config)
        # the backbone's layers (initialised by BlockHead) wrapped, so no layer is built twice
        self.layers = nn.ModuleList([DFlash2DecoderLayer(layer, config) for layer in self.layers])
        self.candidate_selector = CandidateSelector(config)
        self._freeze()

    def candidates(self, unary: torch.Tensor) -> torch.Tensor:
        """The ids [..., K] of the `selector_top_k` largest backbone logits unary [..., V]."""
        return unary.topk(self.config.selector_top_k, dim=-1).indices

    def edge_scores(self, unary, h, prev_ids, candidates) -> torch.Tensor:
        """s(c | p, h) [..., K]: `CandidateSelector.scores`."""
        return self.candidate_selector.scores(unary, h, prev_ids, candidates)

    def walk_step(self, unary: torch.Tensor, h: torch.Tensor, prev_ids: torch.Tensor):
        """(candidates [N, K], their scores [N, K]) of one slot of the walk: backbone logits unary
        [N, V] and final-norm states h [N, H], after the tokens prev_ids [N] (the anchor for slot 1,
        then the draft before)."""
        candidates = self.candidates(unary)
        return candidates, self.edge_scores(unary, h, prev_ids, candidates)

    def describe(self) -> str:
        c = self.config
        title = f"DFlash2 head: {c.num_hidden_layers} layer(s), block {c.block_size} ({c.block_size - 1} drafts per forward)"
        convs = f"convolutions kernel {c.conv_kernel_size} group {c.conv_group_size}"
        return describe_mask_head(self, f"{title}, {convs}, selector top-{c.selector_top_k} rank {c.selector_rank}")
