"""What is trained, and the adapter that reads an unmodified HF target."""

from draftsmith.heads.target import CausalLMAdapter, ForwardResult, tree_attention_mask

__all__ = ["CausalLMAdapter", "ForwardResult", "tree_attention_mask"]
