"""How often retokenizing a server's streamed text gives back the target's own answer ids.

    python scripts/bench_retokenize.py --data DATA_DIR --target TARGET_DIR

On a data folder whose ids are the target's own (local generation), each answer is decoded token
by token as a server's detokenizer streams it (the Rust tokenizer's DecodeStream: one event per
token, or per few tokens of one character), then retokenized three ways:

    per event      each event on its own: what `draftsmith generate --endpoint` does
    whole text     the answer's text at once
    joined         events joined in runs of 1-3 (a stream that fell behind the generation sends
                   the text queued since its last event as one event, as `transformers serve` does)

and the share of answers whose ids come back exactly is printed for each, with how many of the
joined runs' wrong answers the token-count check (`retokenized_inexact`) flags.
"""

from __future__ import annotations

import argparse
import random


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="a `draftsmith generate` folder made locally")
    parser.add_argument("--target", required=True, help="the target folder (its tokenizer)")
    parser.add_argument("--seed", type=int, default=0, help="the random join lengths")
    args = parser.parse_args(argv)

    from tokenizers.decoders import DecodeStream

    from draftsmith.distill.data import DistillData
    from draftsmith.distill.endpoint import retokenize
    from draftsmith.heads.models import load_tokenizer

    tokenizer = load_tokenizer(args.target)
    special = set(tokenizer.all_special_ids)
    rng = random.Random(args.seed)

    exact = {"per event": 0, "whole text": 0, "joined": 0}
    answers = wrong_joined = unflagged = 0
    for row in DistillData(args.data).dataset:
        ids = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m and t not in special]
        if not ids:
            continue
        answers += 1
        stream = DecodeStream([], skip_special_tokens=True)
        events = [e for e in (stream.step(tokenizer._tokenizer, t) for t in ids) if e is not None]
        joined, i = [], 0
        while i < len(events):
            run = rng.choice((1, 1, 2, 3))
            joined.append("".join(events[i : i + run]))
            i += run
        got = {
            "per event": retokenize(tokenizer, events),
            "whole text": retokenize(tokenizer, ["".join(events)]),
            "joined": retokenize(tokenizer, joined),
        }
        for way, tokens in got.items():
            exact[way] += tokens == ids
        if got["joined"] != ids:
            wrong_joined += 1
            unflagged += len(got["joined"]) == len(ids)
    shares = ", ".join(f"{way} {exact[way] / max(answers, 1):.1%}" for way in exact)
    print(f"{answers} answers, ids recovered exactly: {shares}")
    print(f"joined: {wrong_joined} answers wrong, {wrong_joined - unflagged} of them flagged by the token count")


if __name__ == "__main__":
    main()
