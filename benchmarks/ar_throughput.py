"""AR throughput: unmask's AR decoder vs transformers ``model.generate`` on stories260K.

Reproduces the Foundation claim that the AR baseline every decoder is measured against is not
slower than plain transformers: greedy, 128 new tokens, 32 story openings of different lengths,
at batch 1 and batch 8, CPU fp32. Both sides stop on EOS or BOS (the checkpoint's
generation_config), and every prompt's tokens are asserted equal before any time is reported.

Timing: one warm-up pass per (method, batch), then ``--repeats`` rounds in which every prompt
group is run by both methods back to back, in alternating order; each method's time is the sum
over groups of its median, so slow phases of a shared machine hit both methods alike.
TPS = generated tokens (stop token excluded, identical on both sides) / that time.

    python benchmarks/ar_throughput.py [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import unmask
from unmask.decode import DECODERS
from unmask.decode.engine.batching import left_pad

MAX_NEW = 128

# Story openings written for this benchmark, 1 to ~40 words, so batches mix prompt lengths.
PROMPTS = [
    "Once",
    "Lily",
    "The sun",
    "A little cat",
    "Once upon a time",
    "Tom had a big red ball.",
    "One day, a small dog found a stick.",
    "Sara and her mom went to the park.",
    "There was a happy frog who lived by a pond.",
    "Ben wanted to fly his kite, but the wind was too weak.",
    "Mia liked to draw. She drew the sun, the trees and her house.",
    "The old man had a garden full of flowers. Every morning he",
    "Once upon a time, there was a little girl named Lily. She loved to play with her toys.",
    "Max was a brave boy. He was not afraid of the dark, but he was afraid of",
    "Lucy found a little box under her bed. She opened it and saw",
    "Jack and Jill went to the store to buy some milk. On the way, they met a",
    "A tiny bird could not find its nest. It flew to a big tree and asked the owl",
    "Emma had a new doll with a pink dress. She took it everywhere she went, even to",
    "The little car went up the hill very slowly. At the top, it saw a",
    "One night, a little owl looked up at the bright moon and made a wish.",
    "Tim and his dad went to the beach. The water was cold, but Tim",
    "Once there was a big bear who liked to eat honey. One day, the bees",
    "Anna liked to help her mom bake cookies. One day, they made cookies shaped like",
    "The dog barked at the mailman every day. The mailman was sad, so one day he",
    "Sam saw a big truck in front of his house. The truck was full of boxes, and a man",
    "A small fish swam in the deep blue sea. It was lonely because all the other fish",
    "Once upon a time, in a small town, there lived a kind girl named Sue. Sue had a cat named",
    "Ben and Mia built a tall tower with their blocks. Then the tower fell down and Mia started to",
    "The princess lived in a big castle on a hill. She had everything she wanted, but she was not happy because",
    "It was a rainy day, so Lily and her brother stayed inside. They wanted to play a game, but they could not find",
    "Once upon a time, there was a little boy named Tim. Tim loved to play with his red ball in the park. One day, he",
    "There was once a funny monkey who lived in the jungle. He liked to swing from tree to tree and eat bananas. "
    "One sunny morning, the monkey saw",
]


def unmask_run(bundle, ids: list[list[int]]) -> list[list[int]]:
    return DECODERS["ar"].decode(bundle, ids, max_new_tokens=MAX_NEW, stop_token_ids=bundle.stop_token_ids).tokens


def hf_run(bundle, ids: list[list[int]]) -> list[list[int]]:
    """``model.generate`` on the same left-padded batch; rows cut at their first stop token."""
    input_ids, valid, _ = left_pad(ids, bundle.pad_token_id, bundle.device)  # (B, P)
    with torch.inference_mode():
        out = bundle.model.generate(input_ids=input_ids, attention_mask=valid.long(), max_new_tokens=MAX_NEW,
                                    do_sample=False, pad_token_id=bundle.pad_token_id)
    rows = []
    stops = set(bundle.stop_token_ids)
    for row in out[:, input_ids.shape[1]:].tolist():  # (B, new)
        cut = next((i for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


def batches(ids: list[list[int]], size: int) -> list[list[list[int]]]:
    return [ids[i: i + size] for i in range(0, len(ids), size)]


def timed(fn, bundle, group) -> tuple[float, float, list[list[int]]]:
    """(wall seconds, process CPU seconds, tokens per prompt) of one call of ``fn`` on ``group``."""
    t0, c0 = time.perf_counter(), time.process_time()
    tokens = fn(bundle, group)
    return time.perf_counter() - t0, time.process_time() - c0, tokens


def measure(methods: dict, bundle, groups, repeats: int) -> tuple[int, dict, dict]:
    """Generated tokens and, per method, the wall and CPU seconds of the whole prompt set.

    Each group is timed ``repeats`` times per method, the two methods back to back in alternating
    order; a method's total is the sum over groups of its median, so a slow phase of a shared
    machine lands on both methods instead of on one whole pass.
    """
    reference = [row for g in groups for row in methods["generate"](bundle, g)]  # warm-up
    for name, fn in methods.items():  # warm-up, and the token-equality check
        tokens = [row for g in groups for row in fn(bundle, g)]
        bad = [i for i, (a, b) in enumerate(zip(reference, tokens)) if a != b]
        assert not bad, f"batch {len(groups[0])}: {name} and generate differ on prompts {bad}"
    wall = {m: [[] for _ in groups] for m in methods}
    cpu = {m: [[] for _ in groups] for m in methods}
    for r in range(repeats):
        for j, g in enumerate(groups):
            for m in list(methods)[:: 1 if (r + j) % 2 == 0 else -1]:
                s, c, tokens = timed(methods[m], bundle, g)
                assert tokens == reference[j * len(g): (j + 1) * len(g)]
                wall[m][j].append(s)
                cpu[m][j].append(c)
    total = {m: sum(statistics.median(v) for v in wall[m]) for m in methods}
    total_cpu = {m: sum(statistics.median(v) for v in cpu[m]) for m in methods}
    return sum(len(t) for t in reference), total, total_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bundle = unmask.load("stories260K")
    ids = [bundle.encode(p) for p in PROMPTS]
    assert len({len(i) for i in ids}) >= 24, "prompts must differ in length"
    methods = {"unmask": unmask_run, "generate": hf_run}
    print(f"stories260K, {len(PROMPTS)} prompts of {min(map(len, ids))}-{max(map(len, ids))} tokens, greedy, "
          f"{MAX_NEW} new tokens, stop on EOS/BOS, torch threads {torch.get_num_threads()}, repeats {args.repeats}",
          flush=True)
    # Wall-clock TPS is the headline; the CPU-time ratio is printed too because on a shared
    # machine other processes inflate wall time but much less this process's CPU time.
    print(f"\n{'batch':>5} {'tokens':>7} {'unmask TPS':>11} {'generate TPS':>13} {'ratio':>6} {'CPU ratio':>10}")
    for bs in (1, 8):
        generated, wall, cpu = measure(methods, bundle, batches(ids, bs), args.repeats)
        tu, tg = generated / wall["unmask"], generated / wall["generate"]
        print(f"{bs:>5} {generated:>7} {tu:>11.0f} {tg:>13.0f} {tu / tg:>6.2f} {cpu['generate'] / cpu['unmask']:>10.2f}",
              flush=True)


if __name__ == "__main__":
    main()
