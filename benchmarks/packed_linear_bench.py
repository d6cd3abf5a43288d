"""What oneDNN-packed bf16 weights (`envace_core.engines.packed_linear`) change, each lever on and off in one run.

    .venv/bin/python benchmarks/packed_linear_bench.py [--model bundled:smollm2-135m-instruct] \
        [--sections matmul,generate,update] [--json benchmarks/results/packed_linear.json]

Run it alone (no other torch process on the cores), without OMP_NUM_THREADS (all cores, as speed.py).
Sections, all in this process, bf16 (the script stops on a CPU where `packed_linear.available` is false):

1. matmul: the model's body matrices (every ``nn.Linear`` but the LM head, weights cast to bf16) applied in
   turn to an input of M rows, M in (1, 8, 16, 300, 1500): ``F.linear`` vs ``_linear_pointwise`` on the
   packed weight; median of 7 passes, milliseconds per pass. 1 row is a decode step, 1500 a prompt's prefill.
2. generate: `HFEngine` with ``packed_weights=False`` (bf16 weight copies per call, float32 shared-prefix
   attention) vs ``True``, on speed.py's cases (g8: one ~1.5k-token prompt × 8 samples; distinct8: 8
   different prompts × 1; g1), 64 new tokens each (ignore_eos), temperature 1, same seed; per case the
   median of 3 calls, the median of 3 calls with 1 new token (prefill), and decode ms per step =
   (seconds - prefill) / 63. The two engines alternate per case on the same model.
3. update: one `PolicyTrainer.update` on 16 rows (engine_bench's 4 prompts of ~300 tokens × G=4, ≤ 64 new
   tokens, LoRA r=16 q/v), alternating ``trainer.packed_frozen`` False / True three times each (the policy
   moves a little with every update: each update is on the same rows); the minimum of each.

Writes the JSON (every figure, the load average at start and end, versions) and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)

HERE = os.path.dirname(os.path.abspath(__file__))
SECTIONS = ("matmul", "generate", "update")


def _median_ms(fn, k: int = 7) -> float:
    fn()
    ts = []
    for _ in range(k):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1000


def bench_matmul(model) -> dict:
    import torch

    ops = torch.ops.mkldnn
    head = model.get_output_embeddings()
    ws = [m.weight.detach().to(torch.bfloat16) for m in model.modules()
          if isinstance(m, torch.nn.Linear) and m is not head]
    packed = [ops._reorder_linear_weight(w, 8) for w in ws]
    out = {"matrices": len(ws), "passes": {}}
    with torch.inference_mode():
        for rows in (1, 8, 16, 300, 1500):
            xs = {k: torch.randn(1, rows, k).to(torch.bfloat16) for k in {w.shape[1] for w in ws}}
            plain = _median_ms(lambda xs=xs: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in ws])
            pk = _median_ms(lambda xs=xs: [ops._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")
                                           for w, p in zip(ws, packed)])
            out["passes"][str(rows)] = {"f_linear_ms": plain, "packed_ms": pk, "ratio": pk / plain}
            print(f"matmul {rows:>5} rows: F.linear {plain:7.1f} ms, packed {pk:7.1f} ms ({pk / plain:.2f}x)", flush=True)
    return out


def bench_generate(model, tok) -> dict:
    from engine_bench import make_prompt
    from speed import distinct_prompt

    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine

    one = make_prompt(tok, 1500, 0)
    cases = {"g8": ([one], 8), "distinct8": ([distinct_prompt(tok, 1500, v) for v in range(8)], 1), "g1": ([one], 1)}
    engines = {"plain": HFEngine(model, tok, compute_dtype="bfloat16", max_batch_size=8, packed_weights=False),
               "packed": HFEngine(model, tok, compute_dtype="bfloat16", max_batch_size=8)}

    def gen(eng, prompts, n, new):
        sp = SamplingParams(max_new_tokens=new, n=n, temperature=1.0, top_p=1.0, seed=1, ignore_eos=True)
        t0 = time.perf_counter()
        eng.generate(prompts, sp)
        return time.perf_counter() - t0

    for eng in engines.values():  # warm-up, a prompt no case uses
        gen(eng, [distinct_prompt(tok, 256, 1000)], 8, 8)
    out: dict = {name: {} for name in engines}
    for case, (prompts, n) in cases.items():
        for name, eng in engines.items():
            full = statistics.median(gen(eng, prompts, n, 64) for _ in range(3))
            pre = statistics.median(gen(eng, prompts, n, 1) for _ in range(3))
            out[name][case] = {"seconds": full, "prefill_s": pre, "decode_ms_per_step": (full - pre) / 63 * 1000,
                               "tokens_per_s": len(prompts) * n * 64 / full}
            print(f"generate {case:<9} {name:<6}: {full:6.2f} s, prefill {pre:5.2f} s, decode "
                  f"{out[name][case]['decode_ms_per_step']:5.1f} ms/step", flush=True)
    return out


def bench_update(model_dir, tok) -> dict:
    from engine_bench import _train_cfg, group_rows, make_prompt

    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model
    from envace_core.training.trainer import PolicyTrainer

    prompts = [make_prompt(tok, 300, v) for v in range(4)]
    trainer = PolicyTrainer(load_model(model_dir), tok, _train_cfg(4), compute_dtype="bfloat16")
    eng = HFEngine(trainer.model, tok, compute_dtype="bfloat16", max_batch_size=16)
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=64, n=4, temperature=1.0, seed=0))
    rows = group_rows(tok, prompts, outs, offset=0.1)  # + 0.1: no group with equal rewards gives a zero gradient
    runs: dict[str, list[float]] = {"plain": [], "packed": []}
    for packed in (False, True) * 3:
        trainer.packed_frozen = packed
        t0 = time.perf_counter()
        trainer.update(rows)
        runs["packed" if packed else "plain"].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in runs.items()}
    print(f"update: plain {best['plain']:.2f} s, packed frozen layers {best['packed']:.2f} s "
          f"({best['packed'] / best['plain']:.2f}x)", flush=True)
    return {"rows": len(rows), "completion_tokens": sum(len(r.completion_ids) for r in rows), "runs_s": runs,
            "best_s": best, "ratio": best["packed"] / best["plain"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--sections", default=",".join(SECTIONS))
    ap.add_argument("--json", default=os.path.join(HERE, "results", "packed_linear.json"))
    args = ap.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    if not sections or set(sections) - set(SECTIONS):
        ap.error(f"--sections: a comma-separated subset of {','.join(SECTIONS)}")
    import torch
    import transformers

    from envace_core.engines import packed_linear
    from envace_core.models import load_model, load_tokenizer, resolve_model

    if not packed_linear.available(torch.bfloat16, "cpu"):
        print("packed bf16 linears are not available on this CPU / torch build: nothing to measure")
        return 2
    model_dir = resolve_model(args.model)
    tok, model = load_tokenizer(model_dir), load_model(model_dir)
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "model": args.model,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_start": os.getloadavg(),
              "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
              "transformers": transformers.__version__}
    if "matmul" in sections:
        report["matmul"] = bench_matmul(model)
    if "generate" in sections:
        report["generate"] = bench_generate(model, tok)
    if "update" in sections:
        report["update"] = bench_update(model_dir, tok)
    report["load_end"] = os.getloadavg()
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
