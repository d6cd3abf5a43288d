"""`envace` command line: run the pipeline without Flyte, and inspect the model registry.

    envace train [--profile cpu-smoke] [--overrides 'train.iterations=1']
    envace config [--check|--remote] print the resolved config; --check also resolves the model
    envace config --markdown         the table of every setting (README 'Configuration')
    envace warm-start [--overrides 'train.init_adapter=DIR,train.sft_roles=[act]'] [--json]
                                     curate, then make (or reuse) the config's warm start; print its adapter
    envace registry list|show NAME@VERSION|verify NAME@VERSION [--profile ...]
    envace rehearse --task airline/3 [--mode parallel] [--n 4] [--model REF] [--adapter DIR]
                    [--reenter] [--no-verifier] [--max-turns K]      Private Rehearsal on one tau2 task
    envace rehearse --list [DOMAIN]  list the tau2 task ids per split
    envace eval --model REF --bench tau2:airline,bfcl:simple [--rehearsal parallel:4] [--out DIR]
                [--protocol tau2_orchestrator|opening_request] [--trials K] [--split test|full] [--limit N]
                [--user-model REF | --user-url URL]
                                     benchmarks with their own scorers; results.json + report.md + PNGs
    envace adapt-tools --model REF --tools tools.json [--examples ex.jsonl] [--domain retail] [--tasks N]
                [--config PROFILE] [--set k=v ...] [--name NAME] [--registry PATH] [--measure]
                                     teach a model new tools by rehearsal; registers a new version
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError
from envace_core.cli_args import OnceArgumentParser, seed_arg
from envace_core.config import PROFILES, ConfigError, apply_setting, load_config
from envace_core.evaluation.protocols import MAX_STEPS, PROTOCOLS, TAU2_ORCHESTRATOR


def _train(args) -> int:
    from envace_core.stages.curate import curate
    from envace_core.stages.evaluate import evaluate
    from envace_core.stages.preflight import resolve_and_check
    from envace_core.stages.register import register
    from envace_core.stages.train import rollout_and_train
    from envace_core.stages.validate import validate
    from envace_core.stages.warm_start import warm_start

    from envace_core.training.heap import release_free_heap

    def stage(fn, *a):  # each stage's freed heap goes back to the OS before the next (as tasks.resources.timed)
        try:
            return fn(*a)
        finally:
            release_free_heap()

    cfg = resolve_and_check(load_config(args.profile, args.overrides))  # what `make train` checks first
    ds = stage(curate, cfg)
    tr = stage(rollout_and_train, cfg, ds, stage(warm_start, cfg, ds))
    val = stage(validate, cfg, ds, tr)
    ev = stage(evaluate, cfg, ds, tr)
    register(cfg, ds, tr, val, ev, execution_id="cli")
    return 0


def _warm_start(args) -> int:
    """Curate, then make or reuse the warm start of the config (`stages.warm_start.warm_start`: the main job's
    warm_start stage, cached in the store by warm-start id). Progress goes to stderr; stdout gets the
    adapter's URI (a folder a later `--overrides train.init_adapter=...` or `--adapter` takes), or with
    --json the stage's whole record. Without SFT (train.sft_warmup_steps=0) nothing is made: an error."""
    from envace_core.stages.curate import curate
    from envace_core.stages.preflight import resolve_and_check
    from envace_core.stages.warm_start import warm_start

    cfg = load_config(args.profile, args.overrides)
    if cfg.train.sft_warmup_steps <= 0:
        raise EnvaceError("train.sft_warmup_steps=0: this config has no warm start to make (set it > 0)")
    cfg = resolve_and_check(cfg)  # a bad model.ref, train.init_adapter or store fails here, before curate writes
    with contextlib.redirect_stdout(sys.stderr):  # the stages' progress; stdout is the result alone
        record = warm_start(cfg, curate(cfg))
    print(json.dumps(record, indent=1, sort_keys=True, default=str) if args.json else record["adapter_uri"])
    return 0


def _config(args) -> int:
    """Print the resolved config; with --check, also resolve the model and open the stores (--remote: the
    cluster checks of `preflight(remote=True)` instead, nothing downloaded); with
    --markdown, print the README's table of every setting instead (`config.config_table_markdown`)."""
    if args.markdown:
        from envace_core.config import config_table_markdown
        from envace_core.evaluation.options import UnusedOptionError

        if args.check or args.remote:
            flag = "--check" if args.check else "--remote"
            raise UnusedOptionError(f"config --markdown prints the settings table and checks nothing: drop {flag}, "
                                    f"or drop --markdown to check the resolved config")
        load_config(args.profile, args.overrides)  # bad --profile / --overrides stop here, not silently
        print(config_table_markdown())
        return 0
    cfg = load_config(args.profile, args.overrides)
    if args.check or args.remote:
        from envace_core.stages.preflight import resolve_and_check

        # registry:NAME@VERSION → the version's adapter; --remote: the checks a cluster's resolve_config runs
        # (no download, no vLLM needed here)
        cfg = resolve_and_check(cfg, remote=args.remote, resolve_remote=not args.remote)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _registry(args) -> int:
    from envace_core.store.registry import HMAC_KEY_ENV, UNSIGNED, Registry

    reg = Registry(load_config(args.profile, args.overrides).store.registry)
    if args.action == "list":
        if args.ref:
            from envace_core.evaluation.options import UnusedOptionError

            raise UnusedOptionError(f"registry list takes no NAME@VERSION (got {args.ref!r}): "
                                    f"`envace registry show {args.ref}` shows one model")
        models = reg.list()
        if not models:
            print(f"no models registered in {reg.root}", file=sys.stderr)
        for name, version in models:
            print(f"{name}@{version}")
        return 0
    ref = (args.ref or "").removeprefix("registry:")  # the form settings and --model take
    if "@" not in ref:
        raise EnvaceError("give the model as NAME@VERSION (see `envace registry list`)")
    name, version = ref.split("@", 1)
    if args.action == "show":
        print(json.dumps(reg.show(name, version), indent=2))
        return 0
    bad = reg.verify(name, version)
    if bad == [UNSIGNED]:
        print(f"UNSIGNED {name}@{version}: every artifact matches its sha256, but ${HMAC_KEY_ENV} is set and the "
              "manifest carries no signature, so its metrics and lineage are not vouched for")
        return 1
    if bad:
        print(f"TAMPERED {name}@{version}: {len(bad)} file(s) fail verification:")
        state = _artifact_states(reg, name, version)
        for b in bad:
            print(f"  {b}{state(b)}")
        return 1
    print(f"OK {name}@{version}: every artifact matches its sha256")
    return 0


def _artifact_states(reg, name: str, version: str):
    """A function of an item `verify` listed: " (missing)", " (not in the manifest)" or " (changed)" for an
    artifacts/… path of a local registry (its manifest read once, here); "" for other items (the manifest's own
    lines say what they are), and for every item of an S3 registry or a manifest that cannot be read."""
    try:
        recorded = reg.show(name, version)["artifacts"]
        vdir = reg.version_dir(name, version)  # RegistryError for an S3 registry
    except EnvaceError:
        return lambda item: ""

    def state(item: str) -> str:
        if not item.startswith("artifacts/"):
            return ""
        return " (not in the manifest)" if item not in recorded else " (changed)" if (vdir / item).is_file() \
            else " (missing)"
    return state


def _rehearse(args) -> int:
    """Private Rehearsal on one tau2 task, shown step by step (`envace_core.rehearsal.inspect`)."""
    from envace_core.rehearsal.inspect import (
        check_rehearse_args,
        print_result,
        rehearse_task,
        task_ids,
        tasks_in_file,
    )

    if args.tasks is not None and not args.tasks.strip():
        raise EnvaceError("--tasks is empty: give a curated dataset folder or a tasks file, or leave --tasks out")
    check_rehearse_flags(args)
    if args.list is not None:  # --list reads no setting, but a bad --profile / --overrides is still an error
        load_config(args.profile, args.overrides)
    if args.list is not None and args.tasks is not None:  # the file's ids, by domain and split
        groups: dict[tuple[str, str], list[str]] = {}
        for t in tasks_in_file(args.tasks):
            if not args.list or t.domain == args.list:
                groups.setdefault((t.domain, t.split), []).append(t.id)
        if not groups:
            raise EnvaceError(f"--tasks {args.tasks} holds no task" + (f" of domain {args.list!r}" if args.list else ""))
        for (dom, split), ids in sorted(groups.items()):
            print(f"{dom} {split} ({len(ids)}): {' '.join(ids)}")
        return 0
    if args.list is not None:
        from envace_core.envs.tau2.tasks import DOMAINS

        domains = [args.list] if args.list else [d for d in DOMAINS if d != "mock"]
        for dom in domains:
            if dom not in DOMAINS:
                raise EnvaceError(f"unknown tau2 domain {dom!r}; choose one of {', '.join(DOMAINS)}")
            for split, ids in task_ids(dom).items():
                print(f"{dom} {split} ({len(ids)}): {' '.join(ids)}")
        return 0
    cfg = load_config(args.profile, args.overrides)
    check_rehearse_args(cfg, args.task, mode=args.mode, n=args.n, model=args.model, adapter=args.adapter,
                        tasks_file=args.tasks, reenter=args.reenter, no_verifier=args.no_verifier,
                        max_turns=args.max_turns)  # the rehearse workflow's task makes the same checks
    res = rehearse_task(cfg, args.task, args.mode, args.n, adapter_dir=args.adapter, tasks_file=args.tasks,
                                     reenter=True if args.reenter else None,
                                     verifier=False if args.no_verifier else None,
                                     max_turns=args.max_turns)
    print_result(res)
    return 0


def check_rehearse_flags(args) -> None:
    """Raises `UnusedOptionError` for an `envace rehearse` flag that --list would ignore: every flag of a
    rehearsal run (--list only prints task ids). A run's own checks: `rehearsal.inspect.check_rehearse_args`."""
    from envace_core.evaluation.options import UnusedOptionError

    run_flags = {"--task": args.task is not None, "--mode": args.mode is not None, "--n": args.n is not None,
                 "--model": args.model is not None, "--adapter": args.adapter is not None,
                 "--reenter": args.reenter, "--no-verifier": args.no_verifier,
                 "--max-turns": args.max_turns is not None}
    if args.list is not None:
        for flag, given in run_flags.items():
            if given:
                raise UnusedOptionError(f"{flag}: --list only prints task ids and runs nothing; drop {flag} "
                                        "to list, or drop --list to rehearse --task")


def check_unused_flags(args) -> None:
    """Raises `UnusedOptionError` for an `envace eval` flag given a value other than its default that no
    selected bench uses: --split and --protocol (tau2 only), --max-steps (tau2 under tau2_orchestrator),
    --trials (pass^k: tau2 and VitaBench; a BFCL or FinMCP entry runs once), --rehearsal (tau2, VitaBench and
    BFCL multi-turn; it is part of the cache key, so an unused one would re-run cached entries). A bad --bench
    is left to `EvalOptions.check`, which names it."""
    from envace_core.evaluation.options import BenchSpecError, UnusedOptionError, parse_benches, unused_flags

    try:
        specs = parse_benches(args.bench)
    except BenchSpecError:
        return
    for flag, why in unused_flags(specs, split=args.split, protocol=args.protocol, max_steps=args.max_steps,
                                  trials=args.trials, rehearsal=args.rehearsal):
        raise UnusedOptionError(f"{flag}: {why}; drop it or add such a --bench")


def _eval(args) -> int:
    """Benchmark evaluation (`evaluation.harness.run_eval`), then the report (`evaluation.report`)."""
    from envace_core.evaluation import report
    from envace_core.evaluation.harness import run_eval
    from envace_core.evaluation.options import EvalOptions, check_out_folder

    check_unused_flags(args)
    check_out_folder(args.out)  # a folder of the user's files is refused; an earlier --out resumes
    opts = EvalOptions(
        model=args.model, benches=args.bench, out=args.out, rehearsal=args.rehearsal, user_model=args.user_model,
        user_url=args.user_url, user_url_model=args.user_url_model, judge_model=args.judge_model,
        judge_url=args.judge_url, trials=args.trials, split=args.split, limit=args.limit, protocol=args.protocol,
        max_steps=args.max_steps, seed=args.seed, profile=args.profile, overrides=args.overrides)
    res = run_eval(opts)
    paths = report.write_report(res, args.out)
    report.print_summary(res)
    print(f"report: {paths['report']}\nresults: {paths['results']}\nplots: {', '.join(paths['plots'])}")
    return 0


def merged_overrides(overrides: str, sets: list[str] | None) -> dict:
    """`--overrides`, then the `--set KEY=VALUE` values over it, merged into one override mapping.

    Raises:
        ConfigError: a `--set` without "=" or with an unparseable value, or two `--set` that give the same
            setting (named).
    """
    from envace_core.config import deep_merge, parse_overrides

    seen: dict[str, str] = {}
    sets_over: dict = {}
    for s in sets or []:
        key = s.partition("=")[0].strip()
        if "=" not in s or not key:
            raise ConfigError(f"--set {s!r}: write KEY=VALUE, e.g. --set train.iterations=1")
        if key in seen:
            raise ConfigError(f"--set {key} is given twice ({seen[key]!r} and {s!r}): give each setting once")
        seen[key] = s
        sets_over = deep_merge(sets_over, parse_overrides(s))
    return deep_merge(parse_overrides(overrides), sets_over)


def _ci_cell(m: dict | None) -> str:
    if not m or m.get("mean") is None:
        return "—"
    lo, hi = m.get("ci95") or m.get("ci") or (None, None)  # stats.mean_ci's key, or learning.py's
    return f"{m['mean']:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else "")


MEASURED = (("success", "real-environment success"), ("fidelity", "REHEARSE fidelity, new tools"))


def measurement_table(before: dict, after: dict) -> str:
    """Markdown table of two `tool_learning.measure` results (parent vs adapted): mean [95% CI], n."""
    rows = ["| metric (held-out tasks) | parent | adapted | change | n |", "|---|---|---|---|---|"]
    for key, label in MEASURED:
        b, a = before.get(key) or {}, after.get(key) or {}
        delta = (f"{a['mean'] - b['mean']:+.3f}" if a.get("mean") is not None and b.get("mean") is not None
                 else "—")
        rows.append(f"| {label} | {_ci_cell(b)} | {_ci_cell(a)} | {delta} | {a.get('n', b.get('n', '—'))} |")
    return "\n".join(rows)


def _adapt_tools(args) -> int:
    """Tool learning (`envace_core.tool_learning`): validate the inputs, adapt, register, measure."""
    from envace_core.stages.dataset import load_dataset
    from envace_core.store.registry import Registry
    from envace_core.tool_learning.adapt import adapt
    from envace_core.tool_learning.inputs import load_examples, load_tools
    from envace_core.tool_learning.measure import measure
    from envace_core.tool_learning.tasks import HELD_OUT_SPLIT

    if args.tasks < 2:
        raise EnvaceError(f"--tasks must be >= 2 (adaptation needs at least 2 tasks), got {args.tasks}")
    given = [f for f, v in (("--trials", args.trials), ("--seed", args.seed)) if v is not None]
    if given and not args.measure:
        raise EnvaceError(f"{' and '.join(given)} only shape --measure's held-out comparison: add --measure or "
                          f"drop {'them' if len(given) > 1 else 'it'}")
    args.trials, args.seed = (1 if args.trials is None else args.trials), (0 if args.seed is None else args.seed)
    if args.trials < 1:
        raise EnvaceError(f"--trials must be >= 1, got {args.trials}")
    over = merged_overrides(args.overrides, args.set)
    given = (over.get("data") or {}).get("domains")
    if given is not None and given != [args.domain]:
        raise ConfigError(f"data.domains={given!r} (from --set or --overrides) and --domain {args.domain!r} "
                          "differ: the adaptation runs on --domain's tasks; give the domain as --domain only")
    # the adaptation runs on --domain: check data.hidden_tools etc. against it, not the profile's domains
    over = {**over, "data": {**(over.get("data") or {}), "domains": [args.domain]}}
    cfg = load_config(args.config or args.profile, over)
    if args.registry is not None:
        apply_setting(cfg, "store.registry", args.registry, "--registry")
    tools = load_tools(args.tools)  # a bad schema stops here, before any model loads
    examples = load_examples(args.examples, tools) if args.examples else []
    res = adapt(cfg, args.model, tools, examples, domain=args.domain, n_tasks=args.tasks,
                   registry=cfg.store.registry, name=args.name)
    new_ref = f"registry:{res['name']}@{res['version']}"
    manifest = Registry(cfg.store.registry).show(res["name"], res["version"])
    print(f"adapted model: {new_ref}\nlineage manifest: {res['manifest']}\n"
          f"tools: {', '.join(t['name'] for t in manifest['tools'])} ({len(examples)} examples)\n"
          f"parent: {manifest['parent']['ref']}\n"
          f"real calls to the new tools during training: {res['real_calls_to_new_tools']}")
    if args.measure:
        names = [t.spec.name for t in tools]
        held = load_dataset(res["dataset"], HELD_OUT_SPLIT)
        if not held:
            print(f"\nno held-out tasks to measure on: no new tool is a {args.domain} tool or has an "
                  "\"implementation\" and 2+ examples, so no task that needs one can be scored for real")
            return 0
        before = measure(cfg, args.model, held, tools=names, trials=args.trials, seed=args.seed)
        after = measure(cfg, new_ref, held, tools=names, trials=args.trials, seed=args.seed)
        print(f"\nheld-out tasks that need the new tools: {len(held)}\n{measurement_table(before, after)}")
    return 0


SUBCOMMANDS = ("train", "config", "registry", "rehearse", "eval", "adapt-tools", "warm-start")


def split_overrides_error(argv: list[str]) -> str | None:
    """The error for an unquoted `--overrides` the shell split into several words (``--overrides a=1 b=2``,
    ``--overrides train.iterations = 2``), which argparse would report as an unknown subcommand; else None.
    ``--overrides store.root= config`` is no split (an empty value, which the overrides parser names)."""
    for i, word in enumerate(argv[:-1]):
        value = word.partition("=")[2] if word.startswith("--overrides=") else (
            argv[i + 1] if word == "--overrides" else None)
        after = argv[i + 1 if word.startswith("--overrides=") else i + 2:][:1]
        if value is not None and after and not after[0].startswith("-") and (
                "=" in after[0] or value.endswith("=") and after[0] not in SUBCOMMANDS):
            return (f"--overrides takes one argument, but the shell split {' '.join([value, after[0]])!r} into "
                    "words: quote the whole list and separate overrides with commas, e.g. "
                    "--overrides 'train.iterations=2,rollout.group_size=4'")
    return None


def _one_place(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--profile` / `--overrides` from before or after the subcommand (argparse error when both are given),
    defaults filled in; `args.profile_given` / `args.overrides_given` say whether each was given at all."""
    for name, default in (("profile", "cpu-smoke"), ("overrides", "")):
        before, after = getattr(args, name), getattr(args, f"sub_{name}", None)
        if before is not None and after is not None:
            p.error(f"--{name} is given both before ({before!r}) and after ({after!r}) the subcommand: give it "
                    "once" + (" (several overrides go in one comma-separated list)" if name == "overrides" else ""))
        setattr(args, f"{name}_given", before is not None or after is not None)
        setattr(args, name, after if after is not None else before if before is not None else default)
    if getattr(args, "config", None) and args.profile_given and args.config != args.profile:
        p.error(f"--config {args.config!r} and --profile {args.profile!r} name different profiles: give one")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = OnceArgumentParser(prog="envace")
    p.add_argument("--profile", choices=sorted(PROFILES), help="config profile (default cpu-smoke)")
    p.add_argument("--overrides", help="'a.b=v,...', JSON/YAML text, or a file path")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="run the main job in-process (same stages as the Flyte workflow)")
    c = sub.add_parser("config", help="print the resolved configuration")
    c.add_argument("--check", action="store_true", help="also check the model ref and the stores")
    c.add_argument("--remote", action="store_true", help="check as a cluster run's resolve_config does: "
                   "shared (s3://) store, registry, model and DVC remote, no placeholders, buckets reachable; "
                   "nothing is downloaded")
    c.add_argument("--markdown", action="store_true", help="print every setting with its type, default, "
                   "profile values and meaning as a markdown table (the README's) instead")
    r = sub.add_parser("registry", help="list, show or verify registered models")
    r.add_argument("action", choices=["list", "show", "verify"])
    r.add_argument("ref", nargs="?", help="NAME@VERSION (or registry:NAME@VERSION)")
    h = sub.add_parser("rehearse", help="Private Rehearsal on one tau2 task: rehearsals, memory, real run")
    h.add_argument("--task", help="tau2 task id DOMAIN/ID, e.g. airline/3 (see --list)")
    h.add_argument("--tasks", metavar="PATH",
                   help="look --task up in this tasks file instead of tau2's splits: a curated dataset folder "
                        "(<store>/datasets/<version>, synthesized train and held-out tasks included), its "
                        "tasks.parquet, or a .json list of task records")
    h.add_argument("--list", nargs="?", const="", metavar="DOMAIN",
                   help="list the task ids (of --tasks when given) and exit")
    h.add_argument("--mode", choices=["none", "parallel", "sequential"],
                   help="rehearsal mode (default: the profile's rehearsal.mode)")
    h.add_argument("--n", type=int, help="rehearsals N per round (default: the profile's rehearsal.n)")
    h.add_argument("--model", help="base model: a local HF folder, bundled:..., or s3:// (model.ref)")
    h.add_argument("--adapter", help="a LoRA adapter folder, or the s3:// URI of one envace wrote (what `envace "
                   "warm-start` prints, a registry version's .../artifacts/adapter)")
    h.add_argument("--reenter", action="store_true", help="rehearse again before every real step")
    h.add_argument("--no-verifier", action="store_true", help="keep rehearsals the verifier would reject")
    h.add_argument("--max-turns", type=int, help="ACT turns (default: the profile's eval.max_turns)")
    e = sub.add_parser("eval", help="evaluate a model on benchmarks (tau2, BFCL, VitaBench, FinMCP) with their scorers")
    e.add_argument("--model", required=True, help="local HF folder, s3://..., bundled:smollm2-135m-instruct, "
                   "registry:NAME@VERSION (verified, then base model + adapter), or a local LoRA adapter "
                   "folder (over the profile's model.ref)")
    e.add_argument("--bench", required=True, help="comma-separated: tau2:DOMAIN, bfcl:CATEGORY, vita:PATH, finmcp:PATH")
    e.add_argument("--rehearsal", default="none", help="none | parallel:N | sequential:N (tau2, VitaBench and "
                   "BFCL multi-turn; single-turn BFCL and FinMCP never rehearse)")
    e.add_argument("--out", default=".envace/eval", help="output folder (report, results, resume cache): a new or "
                   "empty folder, or an earlier eval --out to resume it")
    e.add_argument("--trials", type=int, default=1, help="k trials per task (pass^k)")
    e.add_argument("--split", default="test", choices=["test", "full"],
                   help="tau2 split (full = every task; tau2:mock has only full)")
    e.add_argument("--limit", type=int, help="first N tasks / entries / samples per bench (smoke runs)")
    e.add_argument("--protocol", default=TAU2_ORCHESTRATOR, choices=list(PROTOCOLS),
                   help="how tau2 runs: tau2_orchestrator = tau2's Orchestrator with a simulated user (tau2-bench's "
                   "own protocol); opening_request = the opening request only, at most eval.max_turns ACT turns, "
                   "no user simulator (fast; what the main job's evaluate stage uses by default)")
    e.add_argument("--max-steps", type=int, default=MAX_STEPS, help="tau2_orchestrator steps per task")
    e.add_argument("--user-model", help="user simulator model ref (default: the evaluated policy)")
    e.add_argument("--user-url", help="user simulator as an OpenAI-compatible base URL (…/v1)")
    e.add_argument("--user-url-model", default="default", help="model name sent to --user-url / --judge-url")
    e.add_argument("--judge-model", help="VitaBench rubric judge model ref (default: the user simulator)")
    e.add_argument("--judge-url", help="VitaBench rubric judge as an OpenAI-compatible base URL")
    e.add_argument("--seed", type=seed_arg, default=0, help="sampling and bootstrap seed, 0..2^31-1")
    a = sub.add_parser("adapt-tools", help="teach a model new tools by rehearsal; registers a new version")
    a.add_argument("--model", required=True, help="the parent: registry:NAME@VERSION, a local HF folder, "
                   "bundled:smollm2-135m-instruct or s3://...")
    a.add_argument("--tools", required=True, help="JSON file: a list (or {\"tools\": [...]}) of OpenAI-format "
                   "tools, each optionally with \"documentation\" and \"implementation\"")
    a.add_argument("--examples", help="JSONL of real (call, result) pairs: {\"tool\", \"arguments\", \"result\"}")
    a.add_argument("--domain", default="retail", help="tau2 domain whose tasks and policy the new tools join")
    a.add_argument("--tasks", type=int, default=16, help="adaptation tasks to build (train + held-out)")
    a.add_argument("--config", choices=sorted(PROFILES), help="profile (same as --profile)")
    a.add_argument("--set", action="append", metavar="KEY=VALUE", help="config override, repeatable "
                   "(applied after --overrides), e.g. --set train.iterations=2")
    a.add_argument("--name", help="registry name of the new version (default: the parent's name, else "
                   "store.model_name)")
    a.add_argument("--registry", help="model registry: folder or s3:// URI (default: store.registry)")
    a.add_argument("--measure", action="store_true", help="also measure parent vs adapted on the held-out tasks")
    a.add_argument("--trials", type=int, default=None, help="--measure: trials per held-out task (default 1)")
    a.add_argument("--seed", type=seed_arg, default=None,
                   help="--measure: sampling and bootstrap seed, 0..2^31-1 (default 0)")
    w = sub.add_parser("warm-start", help="curate, then make (or reuse from the store) the config's SFT warm start; "
                       "print its adapter")
    w.add_argument("--json", action="store_true", help="print the stage's whole record (id, settings, "
                   "examples, losses, seconds) instead of the adapter URI")
    for sp in (t, c, r, h, e, a, w):  # the global options are also accepted after the subcommand (not both)
        sp.add_argument("--profile", dest="sub_profile", choices=sorted(PROFILES),
                        default=argparse.SUPPRESS)
        sp.add_argument("--overrides", dest="sub_overrides", default=argparse.SUPPRESS,
                        help="config overrides: 'a.b=v,...', JSON/YAML text, or a file path")
    split = split_overrides_error(argv)
    if split:
        p.error(split)
    args = p.parse_args(argv)
    _one_place(p, args)
    try:
        commands = (_train, _config, _registry, _rehearse, _eval, _adapt_tools, _warm_start)
        return dict(zip(SUBCOMMANDS, commands))[args.cmd](args)
    except EnvaceError as e:
        print(f"envace: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback; 130 as a shell reports SIGINT
        print("envace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `envace registry show … | head`: the reader left; not an error
        sys.stdout = None  # nothing more to flush to the closed pipe
        return 0


if __name__ == "__main__":
    sys.exit(main())
