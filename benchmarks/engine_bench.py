"""Rollout and training speed of envace on this machine, as ratios from one run.

    .venv/bin/python benchmarks/engine_bench.py [--model bundled:smollm2-135m-instruct] [--sections all]
        [--prompt-tokens 1500] [--max-new 64] [--groups 1,4,8] [--turns 4] [--trajectories 4]
        [--insert-tokens 60] [--step-prompts 4] [--step-prompt-tokens 300] [--G 4] [--matmul 2048]

Sections (comma-separated, or "all"):
  group      (a) one ~--prompt-tokens prompt sampled G ways (HFEngine, bf16), G in --groups: seconds and
             ratio to G=1 (issue goal <= 2x at G=8 on CPU), once with natural stops and once at fixed length
             (ignore_eos: every sample decodes --max-new tokens, so the ratio is the cost of G samples alone).
  multiturn  (b) --trajectories greedy trajectories, --turns turns; each turn appends the completion and an
             inserted tool response of ~--insert-tokens tokens; every turn decodes exactly --max-new tokens.
             HFEngine re-encoding every turn vs the same engine with the prefix cache (`prefix_cache_tokens`),
             in --multiturn-dtype: ratio, and the fraction of generated token ids that are equal (1.0 in
             float32; bf16 rounding can flip a greedy pick) (goal >= 2x at 4 turns).
  trl        (c) one GRPO step (rollouts + one optimizer step on all P*G completions, LoRA r=16 q/v,
             T=1, beta=0) of ours (HFEngine + PolicyTrainer.update, float32 and bf16 compute) vs TRL's
             GRPOTrainer (float32, use_vllm=False, no gradient checkpointing, 4 completions per micro-batch)
             on the same model, prompts, G, max tokens and reward, in this process (goal: ours <= 1.0x TRL).
  floor      (d) FLOPs of that step (forward 2 FLOP per matmul weight per token + 4*layers*d_model*context
             for attention, Kaplan et al. 2020 §2.1; training = forward + backward of activations only
             = 2x forward, LoRA leaves base weights without gradients) over this CPU's measured matmul
             rate (fp32 and bf16), and our step time over that floor. Needs the trl section's timings.
  rss        a fresh subprocess loads the model and runs one PolicyTrainer step with kl_beta > 0:
             its peak RSS (ru_maxrss), and the number of model objects alive (1 = the KL reference is the
             base with adapters disabled, no second model).

Every number is one measurement on a shared machine; the load average at start and end is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import envace_core  # noqa: F401  (offline environment first)

SECTIONS = ("group", "multiturn", "trl", "floor", "rss")
FILLER = ("Agents must verify the user's identity before changing a reservation, must not offer "
          "compensation unless asked, and must confirm every write action with an explicit yes. ")
TOOLS = [{"name": "get_reservation_details", "description": "Get the details of a reservation.",
          "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string"}},
                         "required": ["reservation_id"]}},
         {"name": "cancel_reservation", "description": "Cancel a whole reservation.",
          "parameters": {"type": "object", "properties": {"reservation_id": {"type": "string"}},
                         "required": ["reservation_id"]}}]
REQUESTS = ["Please cancel reservation ZFA04Y, my trip is off.", "What is the status of booking 8JX2WO?",
            "I want to change my flight HAT170 to next Friday.", "Can you add a checked bag to EHGLP3?",
            "My name is Mia Li; list my reservations please.", "Upgrade reservation 4WQ150 to business."]


def _rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def make_prompt(tok, n_tokens: int, variant: int = 0) -> list[int]:
    """A chat prompt (system: tool schemas + policy filler cut to fit; user: one request) of ~n_tokens."""
    def render(policy: str) -> list[int]:
        system = "You are a customer service agent. Tools:\n" + json.dumps(TOOLS) + "\nPolicy:\n" + policy
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": REQUESTS[variant % 6]}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)

    overhead = len(render(""))
    filler = tok.encode(FILLER * (n_tokens // 20 + 2), add_special_tokens=False)
    return render(tok.decode(filler[:max(0, n_tokens - overhead)]))


def reward(text: str) -> float:
    """A cheap, deterministic reward with spread inside a group: closeness of the length to 120 chars."""
    return -abs(len(text) - 120) / 120


# ------------------------------------------------------------------------------------------- (a) group
def bench_group(model, tok, args) -> dict:
    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine

    eng = HFEngine(model, tok, compute_dtype="bfloat16", max_batch_size=max(args.groups))
    prompt = make_prompt(tok, args.prompt_tokens)
    eng.generate([prompt[:64]], SamplingParams(max_new_tokens=2, n=1, seed=0))  # warm-up
    res = {}
    # Natural stops make G=1 decode as many steps as its one sample needs and G=8 as many as its
    # longest sample: the ratio then mixes batching cost with decode length. The fixed-length rows
    # (ignore_eos: every sample decodes exactly --max-new tokens) isolate the cost of sampling G ways.
    for label, fixed in (("natural stops", False), ("fixed length", True)):
        rows = {}
        for g in args.groups:
            t0 = time.perf_counter()
            out = eng.generate([prompt], SamplingParams(max_new_tokens=args.max_new, n=g, temperature=1.0,
                                                        seed=1, ignore_eos=fixed))
            rows[g] = (time.perf_counter() - t0, sum(len(c.token_ids) for c in out[0]),
                       max(len(c.token_ids) for c in out[0]))
        base = rows[args.groups[0]][0]
        print(f"\n(a) group rollout, {label}, prompt {len(prompt)} tokens, {args.max_new} new tokens max, bf16")
        print(f"{'G':>3} {'seconds':>8} {'tokens':>7} {'steps':>6} {'x G=' + str(args.groups[0]):>8}")
        for g, (sec, n, steps) in rows.items():
            print(f"{g:>3} {sec:8.2f} {n:7d} {steps:6d} {sec / base:8.2f}")
        res["fixed" if fixed else "natural"] = {f"G{g}": {"seconds": sec, "tokens": n, "decode_steps": st,
                                                          "ratio": sec / base} for g, (sec, n, st) in rows.items()}
    return res


# ------------------------------------------------------------------------------------------- (b) multi-turn
def _tool_turn(tok, t: int, i: int, n_tokens: int) -> list[int]:
    body = json.dumps({"reservation_id": f"R{i}{t}", "status": "confirmed", "note": FILLER * 4})
    ids = tok.encode(body, add_special_tokens=False)[:n_tokens]
    text = "<|im_end|>\n<|im_start|>tool\n" + tok.decode(ids) + "<|im_end|>\n<|im_start|>assistant\n"
    return tok.encode(text, add_special_tokens=False)


def _run_turns(eng, tok, prompts, args):
    from envace_core.engines.base import SamplingParams

    seqs, outs = list(prompts), []
    # fixed decode length: both engines do the same work even where low-precision greedy picks diverge
    sp = SamplingParams(max_new_tokens=args.max_new, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for t in range(args.turns):
        comps = [c[0] for c in eng.generate(seqs, sp)]
        outs.append([c.token_ids for c in comps])
        seqs = [s + c.token_ids + _tool_turn(tok, t, i, args.insert_tokens) for i, (s, c) in enumerate(zip(seqs, comps))]
    return time.perf_counter() - t0, outs, max(len(s) for s in seqs)


def bench_multiturn(model, tok, args) -> dict:
    from envace_core.engines.hf import HFEngine

    prompts = [make_prompt(tok, args.prompt_tokens, v) for v in range(args.trajectories)]
    dt = args.multiturn_dtype
    plain = HFEngine(model, tok, compute_dtype=dt, max_batch_size=8)
    cached = HFEngine(model, tok, compute_dtype=dt, max_batch_size=8, prefix_cache_tokens=1 << 17)
    t_plain, out_plain, final_len = _run_turns(plain, tok, prompts, args)
    t_cached, out_cached, _ = _run_turns(cached, tok, prompts, args)
    pairs = [(a, b) for ta, tb in zip(out_plain, out_cached) for sa, sb in zip(ta, tb) for a, b in zip(sa, sb)]
    same = sum(a == b for a, b in pairs) / max(len(pairs), 1)
    print(f"\n(b) multi-turn: {args.trajectories} trajectories x {args.turns} turns, greedy, {dt}, fixed "
          f"{args.max_new} new tokens per turn, prompt {len(prompts[0])} tokens, +{args.insert_tokens} inserted "
          f"per turn, final length {final_len}")
    print(f"re-encode {t_plain:.2f} s (prefilled {plain.stats['prompt_tokens']} tokens); incremental "
          f"{t_cached:.2f} s (prefilled {cached.stats['prompt_tokens']}, reused {cached.stats['cached_tokens']}); "
          f"speed-up {t_plain / t_cached:.2f}x; generated token ids equal: {same:.1%}")
    return {"dtype": dt, "reencode_s": t_plain, "incremental_s": t_cached, "speedup": t_plain / t_cached,
            "same_token_fraction": same}


# ------------------------------------------------------------------------------------------- (c) ours vs TRL
def _train_cfg(micro: int, kl_beta: float = 0.0):
    from envace_core.config import TrainConfig

    return TrainConfig(lora_r=16, lora_alpha=32, lora_target_modules=["q_proj", "v_proj"], learning_rate=1e-5,
                       trained_roles=["act"], micro_batch_rows=micro, kl_beta=kl_beta)


def group_rows(tok, prompts, outs, offset: float = 0.0) -> list:
    """ACT TrainingRows of each prompt's sampled group (`outs[i]`: its Completions), advantage = `reward` minus
    the group's mean reward (GRPO's group baseline, METHOD.md §3) plus `offset`."""
    from envace_core.training.rows import TrainingRow

    rows = []
    for p, group in zip(prompts, outs):
        rs = [reward(tok.decode(c.token_ids, skip_special_tokens=True)) for c in group]
        mean = sum(rs) / len(rs)
        rows += [TrainingRow("act", p, c.token_ids, c.logprobs, r - mean + offset) for c, r in zip(group, rs)]
    return rows


def our_step(model_dir, tok, prompts, args, dtype: str, kl_beta: float = 0.0, warmup: list | None = None) -> dict:
    """One GRPO step of ours: G samples per prompt (HFEngine), group-relative advantages, one update.
    `warmup` (prompts): one untimed step on them first, with the same trainer and engine, so that one-time
    costs of this model (weight packing, allocator growth) fall outside the measured step."""
    from envace_core.engines.base import SamplingParams
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model
    from envace_core.training.rows import TrainingRow
    from envace_core.training.trainer import PolicyTrainer

    trainer = PolicyTrainer(load_model(model_dir), tok, _train_cfg(4, kl_beta), compute_dtype=dtype)
    eng = HFEngine(trainer.model, tok, compute_dtype=dtype, max_batch_size=16)
    if warmup:
        outs = eng.generate(warmup, SamplingParams(max_new_tokens=4, n=2, temperature=1.0, seed=1))
        trainer.update([TrainingRow("act", p, c.token_ids, c.logprobs, 1.0 - 2 * k)
                        for p, group in zip(warmup, outs) for k, c in enumerate(group)])
    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=args.max_new, n=args.G, temperature=1.0, seed=0))
    t_gen = time.perf_counter() - t0
    m = trainer.update(group_rows(tok, prompts, outs))
    total = time.perf_counter() - t0
    gen_tokens = sum(len(c.token_ids) for g in outs for c in g)
    # Weight copies alive while the trainer (and its KL reference) exist: all parameter storages in the
    # process over the policy's own (1.0 = one model; the KL reference adds nothing).
    import torch

    def nbytes(params):
        return sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}.values())

    every = nbytes(o for o in gc.get_objects() if isinstance(o, torch.nn.Parameter))
    models = every / nbytes(trainer.model.parameters())
    del trainer, eng
    gc.collect()
    return {"seconds": total, "generate_s": t_gen, "train_s": m["seconds"], "gen_tokens": gen_tokens,
            "models_alive": models, "kl_ref": m.get("kl_ref", 0.0)}


def trl_step(model_dir, tok, prompts, args) -> dict:
    """One optimizer step of TRL's GRPOTrainer on the same workload (float32, as PERF_NOTES measured)."""
    import tempfile

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from envace_core.models import load_model

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.seconds = time.perf_counter() - self.t0

    n = len(prompts) * args.G
    ds = Dataset.from_dict({"prompt": [tok.decode(p) for p in prompts]})
    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    cfg = GRPOConfig(output_dir=out_dir, max_steps=1, per_device_train_batch_size=4, gradient_accumulation_steps=n // 4,
                     num_generations=args.G, max_completion_length=args.max_new, temperature=1.0, beta=0.0,
                     use_vllm=False, bf16=False, use_cpu=True, gradient_checkpointing=False, report_to="none",
                     save_strategy="no", logging_steps=1, disable_tqdm=True, learning_rate=1e-5, seed=0)
    clock = Clock()
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=load_model(model_dir), reward_funcs=lambda completions, **k: [reward(c) for c in completions],
                          args=cfg, train_dataset=ds, processing_class=tok, peft_config=lora, callbacks=[clock])
    trainer.train()
    del trainer
    gc.collect()
    return {"seconds": clock.seconds}


def bench_trl(model_dir, tok, args) -> dict:
    prompts = [make_prompt(tok, args.step_prompt_tokens, v) for v in range(args.step_prompts)]
    res = {"prompt_tokens": [len(p) for p in prompts]}
    res["ours_fp32"] = our_step(model_dir, tok, prompts, args, "float32")
    res["ours_bf16"] = our_step(model_dir, tok, prompts, args, "bfloat16")
    res["trl_fp32"] = trl_step(model_dir, tok, prompts, args)
    t = res["trl_fp32"]["seconds"]
    print(f"\n(c) one GRPO step: {args.step_prompts} prompts of {min(res['prompt_tokens'])}-"
          f"{max(res['prompt_tokens'])} tokens x G={args.G}, <= {args.max_new} new tokens, LoRA r=16 q/v")
    print(f"{'run':<12} {'step s':>7} {'gen s':>6} {'train s':>7} {'x TRL':>6}")
    for k in ("ours_fp32", "ours_bf16"):
        r = res[k]
        print(f"{k:<12} {r['seconds']:7.2f} {r['generate_s']:6.2f} {r['train_s']:7.2f} {r['seconds'] / t:6.2f}")
    print(f"{'trl_fp32':<12} {t:7.2f}")
    res["prompts"] = prompts
    return res


# ------------------------------------------------------------------------------------------- (d) floor
def matmul_rate(n: int, dtype) -> float:
    import torch

    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(3))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_flops(model, prompt_lens: list[int], G: int, gen_tokens: int) -> dict:
    """FLOPs of one GRPO step: prefill each prompt once, decode gen_tokens, train on every completion with its
    prompt computed once per group (forward + activation backward = 2x forward)."""
    import torch

    cfg = model.config
    head = model.get_output_embeddings().weight.numel()
    body = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)) - head
    L, d = cfg.num_hidden_layers, cfg.hidden_size
    c_mean = gen_tokens / (len(prompt_lens) * G)  # completion tokens per sample
    fwd = lambda toks, ctx, with_head: toks * (2 * body + 4 * L * d * ctx + (2 * head if with_head else 0))
    prefill = sum(fwd(p, p / 2, False) for p in prompt_lens)
    decode = sum(fwd(G * c_mean, p + c_mean / 2, True) for p in prompt_lens)
    train_fwd = prefill + decode  # same tokens and contexts, logits at completion positions only
    return {"generate": prefill + decode, "train": 2 * train_fwd, "total": prefill + decode + 2 * train_fwd}


def bench_floor(model, args, trl_res: dict) -> dict:
    import torch

    f32, bf16 = matmul_rate(args.matmul, torch.float32), matmul_rate(args.matmul, torch.bfloat16)
    fl = step_flops(model, trl_res["prompt_tokens"], args.G, trl_res["ours_bf16"]["gen_tokens"])
    floor32, floor16 = fl["total"] / f32, fl["total"] / bf16
    print(f"\n(d) floor: step {fl['total'] / 1e12:.3f} TFLOP (generation {fl['generate'] / 1e12:.3f}); matmul "
          f"{args.matmul}^3 at {torch.get_num_threads()} threads: fp32 {f32 / 1e9:.0f} GFLOP/s, bf16 {bf16 / 1e9:.0f} "
          f"GFLOP/s -> floor {floor32:.2f} s fp32, {floor16:.2f} s bf16")
    print(f"ours fp32 {trl_res['ours_fp32']['seconds'] / floor32:.1f}x its floor; ours bf16 "
          f"{trl_res['ours_bf16']['seconds'] / floor16:.1f}x its floor; TRL fp32 "
          f"{trl_res['trl_fp32']['seconds'] / floor32:.1f}x the fp32 floor")
    return {"tflop": fl["total"] / 1e12, "fp32_gflops": f32 / 1e9, "bf16_gflops": bf16 / 1e9,
            "floor_fp32_s": floor32, "floor_bf16_s": floor16}


# ------------------------------------------------------------------------------------------- item 5: memory
def rss_child(args) -> None:
    """Runs in a fresh process: model load + one training step with the KL term on; prints JSON."""
    from envace_core.models import load_tokenizer, resolve_model

    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    loaded = _rss_gib()
    prompts = [make_prompt(tok, args.step_prompt_tokens, v) for v in range(args.step_prompts)]
    r = our_step(model_dir, tok, prompts, args, "bfloat16", kl_beta=0.04)
    print(json.dumps({"peak_rss_gib": _rss_gib(), "rss_after_tokenizer_gib": loaded, "step_s": r["seconds"],
                      "weight_copies": r["models_alive"], "kl_ref": r["kl_ref"]}))


def bench_rss(args) -> dict:
    cmd = [sys.executable, __file__, "--rss-child", "--model", args.model, "--max-new", str(args.max_new),
           "--G", str(args.G), "--step-prompts", str(args.step_prompts),
           "--step-prompt-tokens", str(args.step_prompt_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    res = json.loads(out)
    print(f"\n(5) one training step (bf16, kl_beta 0.04) in a fresh process: peak RSS {res['peak_rss_gib']:.2f} GiB "
          f"(step {res['step_s']:.1f} s incl. rollouts); kl_ref {res['kl_ref']:.2e}; parameter bytes in the process "
          f"/ the policy's: {res['weight_copies']:.3f} (1.0 = the KL reference is the base with adapters disabled)")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--sections", default="all")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--groups", default="1,4,8")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=4)
    ap.add_argument("--insert-tokens", type=int, default=60)
    ap.add_argument("--multiturn-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--step-prompts", type=int, default=4)
    ap.add_argument("--step-prompt-tokens", type=int, default=300)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--matmul", type=int, default=2048)
    ap.add_argument("--rss-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.groups = [int(g) for g in args.groups.split(",")]
    if args.rss_child:
        rss_child(args)
        return 0
    sections = SECTIONS if args.sections == "all" else tuple(args.sections.split(","))
    if "floor" in sections and "trl" not in sections:
        ap.error("the floor section needs the trl section's timings: add trl")

    import torch

    from envace_core.models import load_model, load_tokenizer, resolve_model

    print(f"load average at start: {os.getloadavg()}; torch threads {torch.get_num_threads()}")
    results = {}
    if "rss" in sections:  # first: Linux carries the parent's RSS high-water mark into an exec'd child
        results["rss"] = bench_rss(args)
    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir)
    if "group" in sections:
        results["group"] = bench_group(model, tok, args)
    if "multiturn" in sections:
        results["multiturn"] = bench_multiturn(model, tok, args)
    if "trl" in sections:
        results["trl"] = bench_trl(model_dir, tok, args)
    if "floor" in sections:
        results["floor"] = bench_floor(model, args, results["trl"])
    print(f"\nload average at end: {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
