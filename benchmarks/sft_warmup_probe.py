"""Before/after SFT warm-up on the bundled SmolLM2-135M: tool-call parse rate and success on held-out tasks.

Usage: .venv/bin/python benchmarks/sft_warmup_probe.py STEPS BATCH_ROWS LR   (e.g. 20 2 5e-4: ~7.5 min on 2 cores)
"""
import json
import sys
import time

import torch

import envace_core  # noqa: F401
from envace_core.config import load_config
from envace_core.envs.tau2.environment import Tau2Environment
from envace_core.envs.tau2.synth import synthesize
from envace_core.envs.tau2.tasks import task_context
from envace_core.training.loop import score
from envace_core.training.policy import load_policy, rollout_params
from envace_core.training.rollout import real_rollouts
from envace_core.training.sft import act_examples, sft_warmup
from envace_core.training.trainer import PolicyTrainer

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 40
G, N_TRAIN = 8, 8
torch.manual_seed(0)
cfg = load_config("cpu-smoke", {"train": {"sft_warmup_steps": STEPS, "sft_batch_rows": int(sys.argv[2]), "sft_learning_rate": float(sys.argv[3])}})
t0 = time.time()
pool = {d: synthesize(d, N_TRAIN + 2, levels=[1], seed=0) for d in ("airline", "retail")}
train = pool["airline"][:N_TRAIN] + pool["retail"][:N_TRAIN]
held = [pool["airline"][N_TRAIN], pool["retail"][N_TRAIN], pool["retail"][N_TRAIN + 1]]
assert not {t.id for t in held} & {t.id for t in train}
print(f"synth {time.time()-t0:.0f}s; held-out {[t.id for t in held]}", flush=True)
model, tok, _ = load_policy(cfg)
trainer = PolicyTrainer(model, tok, cfg.train, compute_dtype=cfg.model.compute_dtype)
from envace_core.engines.hf import HFEngine

engine = HFEngine(trainer.model, tok, compute_dtype=cfg.model.compute_dtype)
p = rollout_params(cfg, temperature=1.0, max_turns=3)

def measure(tag):
    t = time.time(); first = calls = succ = n = 0
    for k, task in enumerate(held):
        ctx = task_context(task, cfg.data.policy_max_chars)
        envs = [Tau2Environment(task.domain) for _ in range(G)]
        for e in envs: e.reset(task)
        trajs = real_rollouts(engine, ctx, envs, p, seed=1000 + k)
        for tr in trajs:
            tr = score(task, tr)
            n += 1
            first += bool(tr.steps and tr.steps[0].action is not None)
            succ += (tr.reward or 0) >= 1.0
        ex = trajs[0].generations[0].text[:160].replace("\n", " ")
        print(f"  [{tag}] {task.id}: first-turn outputs e.g. {ex!r}", flush=True)
    r = {"first_turn_tool_call": first / n, "success": succ / n, "n": n, "seconds": round(time.time() - t)}
    print(tag, json.dumps(r), flush=True)
    return r

before = measure("before")
examples = act_examples(train, tok, cfg.data.policy_max_chars)
print(f"{len(examples)} SFT examples, prompt tokens {min(len(e.prompt_ids) for e in examples)}-"
      f"{max(len(e.prompt_ids) for e in examples)}", flush=True)
t = time.time()
losses = sft_warmup(trainer, examples, STEPS, cfg.train.sft_learning_rate, cfg.train.sft_batch_rows,
                        seed=0, log=lambda s: print(s, flush=True))
print(f"SFT {STEPS} steps {time.time()-t:.0f}s loss {losses[0]:.3f} -> {losses[-1]:.3f}", flush=True)
after = measure("after")
print("RESULT", json.dumps({"steps": STEPS, "losses": [round(x, 4) for x in losses], "before": before, "after": after}))
