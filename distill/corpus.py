"""Text corpora from local files: the Python standard library, a byte-level BPE trained on it, and
code-prefix prompts cut from it. What the demo target (`draftsmith.train.demo_target`) learns from.

    corpus = stdlib_corpus(heldout_every=20)
    tokenizer = train_tokenizer(corpus, vocab_size=4096)
    ids = token_stream(tokenizer, corpus, corpus.train_files)
    rows = extract_prompts(corpus, corpus.heldout_files, limit=200, context_chars=300, max_head_chars=300)
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Tests (and idlelib, lib2to3, turtledemo: apps and demos) are excluded as in most code corpora;
# `encodings` (13% of the bytes: codec tables of hex literals) and `pydoc_data` (7%: English
# help text in one string) are data, not code, and only teach the target to predict tables.
EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages", "dist-packages", "__pycache__",
    "encodings", "pydoc_data",
}  # fmt: skip
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2


class CorpusError(RuntimeError):
    """A corpus that cannot be assembled; the message says where it looked and what it found."""


# --------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    root: Path
    train_files: list[str]  # paths relative to root, posix
    heldout_files: list[str]

    def text(self, rel: str) -> str:
        return (self.root / rel).read_text(encoding="utf-8", errors="replace")

    def fingerprint(self) -> str:
        """Hash of the file list with sizes: a different Python gives a different target."""
        h = hashlib.sha256()
        for split, files in (("train", self.train_files), ("heldout", self.heldout_files)):
            for rel in files:
                h.update(f"{split}:{rel}:{(self.root / rel).stat().st_size}\n".encode())
        return h.hexdigest()

    def num_bytes(self, files: list[str]) -> int:
        return sum((self.root / rel).stat().st_size for rel in files)


def stdlib_corpus(heldout_every: int, max_corpus_bytes: int | None = None) -> Corpus:
    """The interpreter's stdlib sources, sorted by path; every `heldout_every`-th file is
    held out (so both splits sample all of the library); capped at `max_corpus_bytes`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1]) and p.is_file()
    )
    if max_corpus_bytes is not None:
        kept, total = [], 0
        for rel in files:
            size = (root / rel).stat().st_size
            if size > max_corpus_bytes // 20 or total + size > max_corpus_bytes:
                continue  # no single file dominates a small corpus; keep filling with smaller ones
            kept.append(rel)
            total += size
        files = kept
    if len(files) < 2 * heldout_every:
        raise CorpusError(f"found only {len(files)} stdlib .py files under {root}: too few to build a target")
    heldout = [f for i, f in enumerate(files) if i % heldout_every == heldout_every // 2]
    held = set(heldout)
    return Corpus(root, [f for f in files if f not in held], heldout)


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(corpus: Corpus, vocab_size: int):
    """Byte-level BPE on the training files, wrapped as an HF fast tokenizer that adds <s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodable
        show_progress=False,
    )
    tok.train_from_iterator((corpus.text(rel) for rel in corpus.train_files), trainer=trainer)
    # Every sequence starts with <s>, in training and at inference (prompts are tokenized
    # by this same tokenizer), so the model never sees a sequence without it.
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=1_000_000
    )


def token_stream(tokenizer, corpus: Corpus, files: list[str]) -> torch.Tensor:
    """All files as one stream: <s> file </s> <s> file </s> ... (int32)."""
    texts = [corpus.text(rel) for rel in files]
    encoded = tokenizer.backend_tokenizer.encode_batch(texts)  # the Rust tokenizer: parallel, fast
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for enc in encoded:
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


# --------------------------------------------------------------------------- prompts


def extract_prompts(corpus: Corpus, files: list[str], limit: int, context_chars: int, max_head_chars: int) -> list[dict]:
    """Code prefixes ending at a function's signature, its docstring or its first body line
    (rotating), preceded by up to `context_chars` of whole lines before the def.

    A prompt ends at the end of a line, without the newline: in byte-level BPE the newline
    and the next line's indentation form one token, which the model should predict itself.
    Functions are taken in file order and thinned evenly to `limit` (deterministic); those
    whose prefix is longer than `max_head_chars` (long docstrings) are skipped."""
    found = []
    for rel in files:
        source = corpus.text(rel)
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
                found.append((rel, node, lines))
    found.sort(key=lambda t: (t[0], t[1].lineno))
    stride = max(1, len(found) // max(1, limit))
    rows = []
    for rel, node, lines in found[::stride]:
        if len(rows) >= limit:
            break
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        body0 = node.body[0]
        has_doc = isinstance(body0, ast.Expr) and isinstance(body0.value, ast.Constant) and isinstance(body0.value.value, str)
        kind = ("signature", "docstring" if has_doc else "first-line", "first-line")[len(rows) % 3]
        if kind == "signature":
            end = max(node.lineno, body0.lineno - 1)  # 1-based, inclusive
        elif kind == "docstring":
            end = body0.end_lineno
        else:  # the first statement after the docstring, if any
            end = (node.body[1] if has_doc and len(node.body) > 1 else body0).lineno
        head = "".join(lines[first - 1 : end]).rstrip()
        if not head or len(head) > max_head_chars:
            continue
        before = "".join(lines[: first - 1])
        context = before[-context_chars:]
        if len(before) > context_chars and "\n" in context:
            context = context[context.index("\n") + 1 :]  # whole lines only
        rows.append({"prompt": context + head, "file": rel, "line": node.lineno, "kind": kind})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
