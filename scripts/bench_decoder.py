"""Decoder speed: draftsmith's `generate` on its three paths (eager, static cache, compiled)
against Hugging Face `generate`, greedy, batch 1.

    python scripts/bench_decoder.py                      # random Llama pair built in-process (~5 min, 2 CPU cores)
    python scripts/bench_decoder.py --num-draft-tokens 3 --repeats 5 --out bench.json
    python scripts/bench_decoder.py --hidden 512 --layers 8 --draft-layers 2 --max-new-tokens 64
    python scripts/bench_decoder.py --target path/to/target --draft path/to/draft --device cuda
    D=~/.cache/draftsmith; python scripts/bench_decoder.py --target $D/demo-target-cpu/target \\
        --draft $D/demo-target-cpu/draft --prompt-lookup --num-draft-tokens 3 \\
        --prompt-file $D/demo-target-cpu/prompts/heldout.jsonl --no-self-draft \\
        --drafter KIND=DIR --tree KIND=SPEC   # a trained drafter's rows: its chain, its tree (KIND= : none)

One process, one target, the same prompts and the same K for every method:

    hf-generate          target.generate(...)                          target only
    hf-assisted          target.generate(assistant_model=draft, ...)   K fixed on the assistant
    draftsmith           generate(target, drafter)                     eager: dynamic KV cache
    draftsmith-static    generate(..., static_cache=True)              preallocated KV cache
    draftsmith-compiled  generate(..., compile=MODE)                   static cache + torch.compile

Every draftsmith path runs target-only and each drafter available: the draft model (the
target truncated to --draft-layers layers, or --draft; on the static and compiled paths the
draft runs on that path too), a self-draft (a copy of the target, alpha = 1 up to round-off:
what differs is decoder overhead), prompt lookup (--prompt-lookup), and every trained drafter
of --drafter KIND[:NAME]=DIR (or --KIND DIR), each decoding its method's rows: a chain, and for a
method with trees the tree of --tree KIND=SPEC (default: the method's default tree; KIND= : none). The HF rows run on the draft model (--no-hf skips).

Methods are interleaved within every repeat (the order rotates per prompt) so that load from
other work on the machine hits all of them alike; each row reports the median over repeats of
tokens/s, warm-up excluded (compilation happens there and is reported apart), timers
synchronised with the device. EOS is disabled: every run emits exactly --max-new-tokens
tokens. Greedy outputs must be identical across methods; a WARNING row says where they are not.

Costs, measured in the same process: the verify-cost curve v(n) (one target forward over n
tokens at a mid-decode cache length, per path; median over --curve-repeats rounds, one after
each decoding repeat, of blocks of consecutive calls)
and the draft model's one-token step d(1). c = drafting time per drafted token (in the runs) /
v(1); c_step = d(1) / v(1). The analytic speedup of a drafter is
tau * v(1) / (drafting time per call + v(n)) with tau and drafting time measured in the runs
and n the mean tokens fed per call; "of analytic" = measured / analytic speedup, i.e. how much
the decoder loop itself costs on top of the forwards.

Goals: draftsmith target-only >= 1.00x hf-generate, draftsmith speculative >= 1.25x
hf-assisted with the same pair and K; compiled (and static) target-only >= 1.5x eager;
c of the draft model <= 0.25 on the compiled path; the best drafter >= 1.5x target-only and
>= 90% of its analytic speedup.

Without --target, the target is a random Llama (hidden 256, 4 layers, vocab 8192: ~5 ms per
forward on one core, the size class of the project's own small targets) whose output head is
scaled up so that next-token distributions are peaked (as tests/fixtures.py does): with the
default initialisation they are near-uniform and greedy acceptance means nothing. Acceptance
of a random truncated model is near zero and says nothing about trained drafts; it is
reported as measured. The ratios depend on the model size: the bigger the forward, the
smaller the share of decoder overhead (see the third command).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

from draftsmith.eval.bench import BenchConfig, run_bench
from draftsmith.heads.registry import METHODS


def parse_args(argv=None) -> BenchConfig:
    """Flags are the fields of `BenchConfig` (`num_draft_tokens` -> `--num-draft-tokens`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # The help of a flag is the comment beside its field.
    helps = dict(re.findall(r"^    (\w+): [^#\n]*# (.*)$", inspect.getsource(BenchConfig), re.MULTILINE))
    for f in dataclasses.fields(BenchConfig):
        flags = ["--" + f.name.replace("_", "-")] + (["-k"] if f.name == "num_draft_tokens" else [])
        kwargs = dict(dest=f.name, help=helps.get(f.name))
        if isinstance(f.default, bool):
            parser.add_argument(*flags, action="store_true", **kwargs)
        elif isinstance(f.default, tuple):  # a repeated flag
            parser.add_argument(*flags, action="append", default=None, **kwargs)
        else:
            kind = str if f.default is None else type(f.default)
            parser.add_argument(*flags, type=kind, default=f.default, **kwargs)
    taken = {f.name for f in dataclasses.fields(BenchConfig)}
    for kind in (k for k in METHODS if k not in taken):  # `--KIND DIR`: short for `--drafter KIND=DIR`
        to_spec = lambda folder, kind=kind: f"{kind}={folder}"  # noqa: E731
        parser.add_argument(
            f"--{kind}", dest="drafter", action="append", type=to_spec, metavar="DIR", help=f"--drafter {kind}=DIR"
        )
    try:
        return BenchConfig(**vars(parser.parse_args(argv)))
    except ValueError as err:
        parser.error(str(err))


def main(argv=None) -> None:
    run_bench(parse_args(argv))


if __name__ == "__main__":
    main()
