"""One decode step's attention over bf16 prompts, classic path vs torch's fused CPU kernel (`shared_prefix.attend`).

    .venv/bin/python benchmarks/decode_attention.py [--layers 30] [--calls 20] [--rounds 2] [--json PATH]

Run it alone (no other torch process: two stall each other on 2 cores). For each case, `--layers` layers of
SmolLM2-135M's attention shapes (3 KV heads, 3 query heads per KV head, head dim 64) hold bf16 prompt keys and
values (as `HFEngine` keeps them with packed bf16 weights) and 20 generated tokens per row in float32; one step
= `attend` on every layer once. The classic path (``shared_prefix.FUSED_ATTENTION = False``) and the fused route
are timed alternately, --rounds times each, each figure the mean of --calls steps after two warm-up steps:

  distinct8     8 prompts of 1 500 tokens, one row each (speed.py's distinct8)
  g8            one prompt of 1 500 tokens, 8 rows (speed.py's g8)
  g1            one prompt of 1 500 tokens, one row (speed.py's g1; an evaluation episode's decode)
  act_turn1     one prompt of 1 800 tokens, 4 rows (a GRPO group's first ACT turn, G = 4)
  root_60       4 prompts sharing a 1 500-token root, then 60 tokens each (4 to 0 padded): a group's later turn
  root_300      the same with 300-token tails (0 to 150 padded)

Prints a markdown table (ms per step, fused / classic) and writes --json (default
benchmarks/results/decode_attention.json) through `decode_ab.write_report`: per case the best figures and the
ratio ("summary"), every round's figure ("runs"), the command line, load averages, date and CPU flags ("details").
Synthetic random keys: the timing does not depend on the values.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

H_KV, G, D, OWN = 3, 3, 64, 20
# name -> (prompts P, rows per prompt r, root tokens, tokens after the root, padding of each prompt's tail)
CASES = {
    "distinct8": (8, 1, 0, 1500, [0] * 8),
    "g8": (1, 8, 0, 1500, [0]),
    "g1": (1, 1, 0, 1500, [0]),
    "act_turn1": (1, 4, 0, 1800, [0]),
    "root_60": (4, 1, 1500, 60, [0, 1, 2, 4]),
    "root_300": (4, 1, 1500, 300, [0, 50, 100, 150]),
}


def make_layer(prompts: int, rows: int, root: int, tail: int, pads: list[int], seed: int):
    """A `SharedPrefixLayer` (bf16 prompts) with OWN generated tokens per row, and one step's query."""
    import torch

    from envace_core.engines import shared_prefix

    g = torch.Generator().manual_seed(seed)
    width = root + tail
    keys = torch.randn(prompts, H_KV, width, D, generator=g)
    values = torch.randn(prompts, H_KV, width, D, generator=g)
    keys[:, :, :root], values[:, :, :root] = keys[:1, :, :root], values[:1, :, :root]
    mask = torch.ones(prompts, width, dtype=torch.bool)
    for i, n in enumerate(pads):  # a shorter tail: its padding sits between the root and the tail
        mask[i, root:root + n] = False
    owner = torch.arange(prompts).repeat_interleave(rows)
    split = shared_prefix.root_split(mask, root) if root else None
    layer = shared_prefix.SharedPrefixLayer(keys, values, mask, owner, OWN, torch.bfloat16, split)
    s = prompts * rows
    layer.update(torch.randn(s, H_KV, OWN, D, generator=g), torch.randn(s, H_KV, OWN, D, generator=g))
    return layer, torch.randn(s, H_KV * G, 1, D, generator=g)


def time_case(spec: tuple, layers: int, calls: int, rounds: int) -> dict:
    from envace_core.engines import shared_prefix

    stack = [make_layer(*spec, seed=i) for i in range(layers)]
    figures: dict[str, list[float]] = {"classic": [], "fused": []}
    taken = None
    switch = shared_prefix.FUSED_ATTENTION
    try:
        for _ in range(rounds):
            for variant in ("classic", "fused"):
                shared_prefix.FUSED_ATTENTION = variant == "fused"

                def step():
                    for layer, q in stack:
                        shared_prefix.attend(layer, q, layer.own_keys, layer.own_values, D ** -0.5)

                step()
                step()
                t0 = time.perf_counter()
                for _ in range(calls):
                    step()
                figures[variant].append((time.perf_counter() - t0) / calls * 1e3)
                if variant == "fused":
                    taken = stack[0][0].fused_route()[0]
    finally:
        shared_prefix.FUSED_ATTENTION = switch
    best = {k: min(v) for k, v in figures.items()}
    return {"ms_per_step": figures, "best_ms_per_step": best, "fused_over_classic": best["fused"] / best["classic"],
            "fused_route_taken": taken}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated subset of " + ",".join(CASES))
    ap.add_argument("--json", default=None, help="default benchmarks/results/decode_attention.json")
    args = ap.parse_args(argv)
    for name in ("layers", "calls", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases:
        ap.error(f"--cases is empty; choose from {','.join(CASES)}")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; choose from {','.join(CASES)}")
    from decode_ab import json_argument, write_report

    try:
        args.json = json_argument(args.json, os.path.join(HERE, "results", "decode_attention.json"))
    except ValueError as e:
        ap.error(f"--json: {e}")

    import torch

    from envace_core.engines import shared_prefix

    if not shared_prefix.fused_kernel_available():
        print("this torch has no fused CPU attention kernel: nothing to compare", file=sys.stderr)
        return 1
    load0 = os.getloadavg()
    results = {c: time_case(CASES[c], args.layers, args.calls, args.rounds) for c in cases}
    lines = ["| case | classic ms/step | fused ms/step | fused / classic |", "|---|---|---|---|"]
    for c, r in results.items():
        b = r["best_ms_per_step"]
        lines.append(f"| {c} | {b['classic']:.2f} | {b['fused']:.2f} | **{r['fused_over_classic']:.2f}** |")
    runs = {c: r.pop("ms_per_step") for c, r in results.items()}
    write_report(args.json, results, runs, {"load_average_start": load0, "torch": torch.__version__,
                                            "threads": torch.get_num_threads(), "layers": args.layers,
                                            "calls": args.calls, "rounds": args.rounds}, "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
