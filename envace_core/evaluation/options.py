"""What an evaluation run covers: the benches, the Private Rehearsal mode and the run options, and their fingerprint for the resume cache."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from envace_core import EnvaceError
from envace_core.config import RunConfig, parse_overrides
from envace_core.evaluation.protocols import (
    MAX_STEPS,
    TAU2_ORCHESTRATOR,
    USER_MAX_NEW_TOKENS,
    check_protocol,
)
from envace_core.evaluation.report import REPORT_FILES
from envace_core.models import (
    ResolvedModel,
)
from envace_core.store.files import writable_dir_problem

BENCHES = ("tau2", "bfcl", "vita", "finmcp")
TAU2_DOMAINS = ("airline", "retail", "telecom", "mock")
SPLITS = ("test", "full")
REHEARSAL_MODES = ("none", "parallel", "sequential")
REHEARSAL_APPLIES_TO = "tau2, VitaBench and BFCL multi-turn; single-turn BFCL and FinMCP never rehearse"


class BenchSpecError(EnvaceError):
    """A `--bench` spec names an unknown benchmark, domain or category, or a missing path."""


# ------------------------------------------------------------------------------------------ specs
@dataclass(frozen=True)
class BenchSpec:
    """One benchmark selection: `bench` (one of BENCHES) and `arg` (tau2 domain, bfcl category, or path)."""

    bench: str
    arg: str

    @property
    def label(self) -> str:
        return f"{self.bench}:{self.arg}"


def _bfcl_choices() -> list[str]:
    from envace_core.evaluation.bfcl import ALIASES, SUPPORTED_CATEGORIES

    return list(ALIASES) + list(SUPPORTED_CATEGORIES)


def parse_benches(text: str) -> list[BenchSpec]:
    """Parse ``"tau2:airline,bfcl:simple,vita:/data/vita,finmcp:/data/fin.json"``.

    BFCL categories are bfcl's names (``simple`` = ``simple_python``). Raises `BenchSpecError` naming the
    offending item and the valid choices, an empty item (a stray comma: ``tau2:airline,``), or a bench listed
    twice (also under an alias: ``bfcl:simple,bfcl:simple_python``).
    """
    specs: list[BenchSpec] = []
    seen: dict[BenchSpec, str] = {}  # spec -> the item that named it first
    items = [s.strip() for s in (text or "").split(",")]
    if not (text or "").strip():
        raise BenchSpecError(f"--bench is empty; give e.g. tau2:airline,bfcl:simple (benchmarks: {', '.join(BENCHES)})")
    if "" in items:
        raise BenchSpecError(f"--bench {text!r} has an empty item (a stray comma): separate BENCH:ARG items with "
                             "single commas, nothing before the first or after the last, e.g. tau2:airline,bfcl:simple")
    for item in items:
        bench, sep, arg = item.partition(":")
        bench, arg = bench.strip(), arg.strip()
        if bench in BENCHES and not sep:
            what = {"tau2": "a domain, e.g. tau2:airline", "bfcl": "a category, e.g. bfcl:simple"}.get(
                bench, f"the path of its data, e.g. {bench}:/data/{bench}")
            raise BenchSpecError(f"--bench item {item!r}: {bench} needs {what} after a colon")
        if bench not in BENCHES or not sep:
            raise BenchSpecError(f"--bench item {item!r}: unknown benchmark {bench!r}; write BENCH:ARG with BENCH "
                                 f"one of {', '.join(BENCHES)} (e.g. tau2:airline, bfcl:simple, vita:PATH, finmcp:PATH)")
        if bench == "tau2" and arg not in TAU2_DOMAINS:
            raise BenchSpecError(f"--bench item {item!r}: unknown tau2 domain {arg!r}; choose one of "
                                 f"{', '.join(TAU2_DOMAINS)}")
        if bench == "bfcl":
            from envace_core.evaluation.bfcl import ALIASES

            if arg not in _bfcl_choices():
                raise BenchSpecError(f"--bench item {item!r}: unknown or unsupported BFCL category {arg!r}; "
                                     f"choose one of {', '.join(_bfcl_choices())}")
            arg = ALIASES.get(arg, arg)
        if bench in ("vita", "finmcp"):
            if not arg or not os.path.exists(Path(arg).expanduser()):  # no OSError on over-long names
                raise BenchSpecError(f"--bench item {item!r}: {bench} needs the path of its data, e.g. "
                                     f"{bench}:/data/{bench}; {arg or '(empty)'} does not exist")
            arg = str(Path(arg).expanduser().resolve())
        spec = BenchSpec(bench, arg)
        if spec in seen:
            same = "" if seen[spec] == item else ", which name the same bench"
            raise BenchSpecError(f"--bench lists {seen[spec]!r}" + (f" and {item!r}{same}" if same else " twice")
                                 + "; list each bench once (a second copy would run nothing more)")
        seen[spec] = item
        specs.append(spec)
    return specs


def check_bench_data(specs: list[BenchSpec]) -> None:
    """Load the data of every vita:PATH and finmcp:PATH in `specs` (cheap next to a model), so that a path
    with no task files or a malformed one is refused before any model loads. Raises `BenchSpecError`
    naming the --bench item and the loader's reason (`envs.vita.load_vitabench`, `finmcp.load_finmcp`)."""
    for s in specs:
        if s.bench not in ("vita", "finmcp"):
            continue
        if s.bench == "vita":
            from envace_core.envs.vita import load_vitabench as load
        else:
            from envace_core.evaluation.finmcp import load_finmcp as load
        try:
            load(s.arg)
        except EnvaceError as e:
            raise BenchSpecError(f"--bench item {s.label!r}: {e}") from None


def rehearsal_n_bounds() -> tuple[int, int]:
    """(lowest, highest) N of a rehearsal round: the bounds of the setting ``rehearsal.n`` (`RehearsalConfig`),
    which every N a command or workflow takes (``--rehearsal parallel:N``, ``--n``) must also pass."""
    from annotated_types import Ge, Le

    from envace_core.config_sections import RehearsalConfig

    meta = RehearsalConfig.model_fields["n"].metadata
    return (next(int(m.ge) for m in meta if isinstance(m, Ge)), next(int(m.le) for m in meta if isinstance(m, Le)))


def parse_rehearsal(text: str) -> tuple[str, int]:
    """``none`` | ``parallel:N`` | ``sequential:N`` -> (mode, n), n = 0 for none. N must be within the bounds
    of the setting ``rehearsal.n`` (`rehearsal_n_bounds`: 1..64). Raises `EnvaceError` naming --rehearsal and
    `text` for a malformed item or an N out of those bounds."""
    lo, hi = rehearsal_n_bounds()
    mode, _, n = (text or "none").strip().partition(":")
    if mode == "none" and not n:
        return "none", 0
    if mode not in REHEARSAL_MODES[1:] or not (n.isascii() and n.isdigit()):  # not '²'/'٣', '-1'
        raise EnvaceError(f"--rehearsal {text!r}: write none, parallel:N or sequential:N with {lo} <= N <= {hi} "
                          "(e.g. parallel:4)")
    if not lo <= int(n) <= hi:
        raise EnvaceError(f"--rehearsal {text!r}: N = {int(n)} is outside {lo}..{hi}, the bounds of the setting "
                          f"rehearsal.n; write none, parallel:N or sequential:N with {lo} <= N <= {hi}")
    return mode, int(n)


# ----------------------------------------------------------------------------------------- options
@dataclass
class EvalOptions:
    """What `envace eval` takes (see the CLI help). `limit`: first N tasks/entries/samples per bench (None =
    all); `trials`: k for pass^k (tau2, VitaBench); `split`: tau2 only (the other benches have one set);
    `protocol`: how tau2 is run and scored (`evaluation.protocols`: tau2_orchestrator, opening_request);
    `max_steps`: tau2_orchestrator steps (agent + user messages); `user_url_model`:
    the model name sent to `user_url`; `judge_url`/`judge_model`: VitaBench rubric judge (default: the user
    simulator)."""

    model: str
    benches: str
    out: str
    rehearsal: str = "none"
    user_model: str | None = None
    user_url: str | None = None
    user_url_model: str = "default"
    judge_model: str | None = None
    judge_url: str | None = None
    trials: int = 1
    split: str = "test"
    limit: int | None = None
    protocol: str = TAU2_ORCHESTRATOR
    max_steps: int = MAX_STEPS
    user_max_new_tokens: int = USER_MAX_NEW_TOKENS
    seed: int = 0
    profile: str = "cpu-smoke"
    overrides: str = ""
    registry: str | None = None

    def check(self, specs: list[BenchSpec] | None = None, make_out: bool = True) -> None:
        """Raises EnvaceError for an empty or blank --out, --rehearsal, --user-url, --user-model, --judge-url,
        --judge-model or --user-url-model (given but with no text: never read as "not given"), a malformed
        --rehearsal or one whose N is outside rehearsal.n's bounds (`parse_rehearsal`), an option out
        of range, a malformed --user-url / --judge-url, with the selected benches `specs` a flag they do not
        use (`check_used`) or --split test with tau2:mock (mock has only tau2's base split, which --split full
        runs), or an --out folder that cannot be created or written (it is created here, last; with
        `make_out` False only a non-folder in its way is refused, and `make_out()` creates it later)."""
        for flag, value in (("--out", self.out), ("--rehearsal", self.rehearsal), ("--user-url", self.user_url),
                            ("--user-model", self.user_model), ("--judge-url", self.judge_url),
                            ("--judge-model", self.judge_model), ("--user-url-model", self.user_url_model)):
            if value is not None and not str(value).strip():
                raise EnvaceError(f"{flag} is empty: give a value or leave the flag out")
        parse_rehearsal(self.rehearsal)
        if self.trials < 1:
            raise EnvaceError(f"--trials must be >= 1, got {self.trials}")
        if self.split not in SPLITS:
            raise EnvaceError(f"--split {self.split!r}: choose one of {', '.join(SPLITS)}")
        if self.limit is not None and self.limit < 1:
            raise EnvaceError(f"--limit must be >= 1 (or omitted for all), got {self.limit}")
        check_protocol(self.protocol)
        if self.max_steps < 2:
            raise EnvaceError(f"--max-steps must be >= 2, got {self.max_steps}")
        if self.user_model and self.user_url:
            raise EnvaceError("give at most one of --user-model and --user-url")
        if self.judge_model and self.judge_url:
            raise EnvaceError("give at most one of --judge-model and --judge-url")
        for flag, url in (("--user-url", self.user_url), ("--judge-url", self.judge_url)):
            if url:
                check_url(flag, url)
        if specs is not None:
            check_used(self, specs)
            if self.split == "test" and BenchSpec("tau2", "mock") in specs:
                raise EnvaceError("--split test: tau2 domain 'mock' has no test split (its only split is base, all "
                                  "its tasks): give --split full to run them")
        out = Path(self.out).expanduser()
        try:
            blocker = next((q for q in (out, *out.parents) if q.exists()), None)
        except OSError as e:  # a name longer than the file system allows (ENAMETOOLONG), ...
            raise EnvaceError(f"--out: cannot use the path ({e.strerror or e})") from None
        if blocker is not None and not blocker.is_dir():
            raise EnvaceError(f"--out {self.out!r}: {str(blocker)!r} exists and is not a folder (the report and "
                              "the resume cache are written under --out)")
        if make_out:
            self.make_out()

    def make_out(self) -> None:
        """Create the --out folder and check it is writable; raises EnvaceError otherwise."""
        why = writable_dir_problem(self.out)  # checked before any model loads
        if why:
            raise EnvaceError(f"--out {self.out!r}: cannot write there ({why}): give a folder you can create and "
                              "write (the report and the resume cache are written under --out)")


# what `envace eval` writes in its --out folder: `report.REPORT_FILES` and `harness.run_eval`'s resume cache
CACHE_DIR = "cache"  # cache/<fingerprint: 16 hex>/, one folder per fingerprint


def _is_eval_cache(d: Path) -> bool:
    """`d` is a folder whose entries are all `run_eval` cache folders (16 hex digits: a fingerprint)."""
    return d.is_dir() and all(c.is_dir() and len(c.name) == 16 and all(ch in "0123456789abcdef" for ch in c.name)
                              for c in d.iterdir())


def _is_eval_results(f: Path) -> bool:
    """`f` is a results.json that `report.write_report` wrote (a JSON object with a fingerprint and benches)."""
    try:
        data = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(data, dict) and {"fingerprint", "benches"} <= data.keys()


def check_out_folder(out: str) -> None:
    """Refuse an ``envace eval`` --out whose files the report would replace or the run would add to: a folder
    inside a model registry version (one holding manifest.json and artifacts/, or under one), or an existing
    non-empty folder that is not an earlier eval --out. An earlier --out (entries only `REPORT_FILES`, their
    ``.tmp`` siblings and ``cache/``, with eval's cache folders or eval's results.json) is accepted: the run
    resumes from its cache.
    A missing or empty folder is accepted; a path that is not a folder is left to `EvalOptions.check`. Reads
    only. Raises `EnvaceError` naming --out, what is there, and to choose an empty or new folder."""
    from envace_core.store.registry import MANIFEST

    d = Path(out).expanduser()
    try:
        for q in (d, *d.parents):
            if (q / MANIFEST).is_file() and (q / "artifacts").is_dir():
                raise EnvaceError(f"--out {out!r} is inside the model registry version {str(q)!r} (its artifacts "
                                  f"are checked against its {MANIFEST}): choose an empty or new folder outside the "
                                  "registry")
        if not d.is_dir():
            return
        names = sorted(e.name for e in d.iterdir())
    except OSError:
        return  # an unusable path: `EvalOptions.check` names it
    if not names:
        return
    ours = {*REPORT_FILES, *(f + ".tmp" for f in REPORT_FILES), CACHE_DIR}  # .tmp: an atomic write cut short
    foreign = [n for n in names if n not in ours]
    why = None
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        why = f"holds files eval did not write ({shown})"
    elif not (_is_eval_cache(d / CACHE_DIR) or _is_eval_results(d / "results.json")):
        why = f"holds {', '.join(names)} but no eval resume cache ({CACHE_DIR}/<fingerprint>/) or eval results.json"
    if why:
        raise EnvaceError(f"--out {out!r} {why}: eval writes {', '.join(REPORT_FILES[:3])}, PNGs and its resume "
                          f"cache there, replacing files of those names; choose an empty or new folder (or an "
                          "earlier eval --out, to resume its run)")


def check_url(flag: str, url: str) -> None:
    """Raises EnvaceError naming `flag` unless `url` is an http(s) URL with a host (an OpenAI-compatible
    base URL such as http://localhost:8000/v1)."""
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # e.g. an unclosed [IPv6 or a port that is not a number
        ok = False
    if not ok:
        raise EnvaceError(f"{flag} {url!r} is not an http(s) URL with a host: give the OpenAI-compatible "
                          "endpoint's base URL, e.g. http://localhost:8000/v1")


def uses(opts: EvalOptions, specs: list[BenchSpec]) -> dict[str, bool]:
    """What the selected benches `specs` call: ``user`` (a user simulator: tau2 under tau2_orchestrator, and
    VitaBench's judge when neither --judge-url nor --judge-model is given), ``judge`` (VitaBench's rubric
    judge), ``tau2_user`` (tau2 under tau2_orchestrator: --max-steps counts its steps) and ``tau2``."""
    benches = {s.bench for s in specs}
    tau2_user = "tau2" in benches and opts.protocol == TAU2_ORCHESTRATOR
    judge = "vita" in benches
    return {"user": tau2_user or (judge and not (opts.judge_url or opts.judge_model)), "judge": judge,
            "tau2_user": tau2_user, "tau2": "tau2" in benches}


class UnusedOptionError(EnvaceError):
    """A user-simulator or judge flag that no selected bench or protocol uses (it would be ignored)."""


def unused_flags(specs: list[BenchSpec], *, split: str = "test", protocol: str = TAU2_ORCHESTRATOR,
                 max_steps: int = MAX_STEPS, trials: int = 1, rehearsal: str | None = "none") -> list[tuple[str, str]]:
    """``(flag, why)`` for each of --split, --protocol, --max-steps, --trials and --rehearsal given a value other
    than its default (the keyword defaults, `envace eval`'s) that no bench in `specs` uses, in that order; `why`
    says why it is unused and what would use it. --split and --protocol: tau2 only; --max-steps: tau2 under
    tau2_orchestrator (it counts the orchestrator's steps); --trials: pass^k, tau2 and VitaBench (a BFCL or
    FinMCP entry runs once); --rehearsal: tau2, VitaBench and BFCL multi-turn. The one rule for `envace eval`
    (`cli.check_unused_flags`) and the benchmarks that take these flags."""
    from envace_core.evaluation.bfcl import MULTI_TURN_CATEGORIES

    benches = {s.bench for s in specs}
    tau2 = "tau2" in benches
    rehearses = bool(benches & {"tau2", "vita"}) or any(s.bench == "bfcl" and s.arg in MULTI_TURN_CATEGORIES
                                                         for s in specs)
    unused = "no selected bench uses it"
    rules = (
        ("--split", split != "test", tau2, f"{unused} (it picks tau2's task split)"),
        ("--protocol", protocol != TAU2_ORCHESTRATOR, tau2, f"{unused} (it says how tau2 runs)"),
        ("--max-steps", max_steps != MAX_STEPS, tau2 and protocol == TAU2_ORCHESTRATOR,
         (f"--protocol {protocol} runs no orchestrator" if tau2 else unused)
         + f" (it counts tau2 steps under --protocol {TAU2_ORCHESTRATOR})"),
        ("--trials", trials != 1, bool(benches & {"tau2", "vita"}),
         f"{unused} (pass^k trials run for tau2 and VitaBench only)"),
        ("--rehearsal", (rehearsal or "none").strip() != "none", rehearses,
         f"{unused} (Private Rehearsal runs on tau2, VitaBench and BFCL multi-turn; single-turn BFCL and FinMCP "
         "never rehearse)"))
    return [(flag, why) for flag, given, used, why in rules if given and not used]


def check_used(opts: EvalOptions, specs: list[BenchSpec]) -> None:
    """Raises `UnusedOptionError` naming --user-url / --user-model, --judge-url / --judge-model, or a
    --user-url-model other than "default", when the selected benches `specs` under ``--protocol`` never
    call what it sets (`uses`), and why: a flag that would be silently ignored."""
    use = uses(opts, specs)
    for flag, value in (("--judge-url", opts.judge_url), ("--judge-model", opts.judge_model)):
        if value is not None and not use["judge"]:
            raise UnusedOptionError(f"{flag}: no selected bench uses a judge (VitaBench does)")
    for flag, value in (("--user-url", opts.user_url), ("--user-model", opts.user_model)):
        if value is None or use["user"]:
            continue
        if use["tau2"]:
            why = (f"--protocol {opts.protocol} runs no user simulator ({TAU2_ORCHESTRATOR} does)"
                   + ("; VitaBench is judged by --judge-url / --judge-model" if use["judge"] else ""))
        elif use["judge"]:
            why = "no selected bench uses a user simulator (tau2 does); VitaBench is judged by " \
                  "--judge-url / --judge-model"
        else:
            why = (f"no selected bench uses a user simulator (tau2 under --protocol {TAU2_ORCHESTRATOR} does, "
                   "and VitaBench's judge by default)")
        raise UnusedOptionError(f"{flag}: {why}")
    if opts.user_url_model != "default" and not (opts.user_url and use["user"]) \
            and not (opts.judge_url and use["judge"]):
        raise UnusedOptionError("--user-url-model: it names the model sent to --user-url / --judge-url, and this "
                                "run calls neither")


def _episode_options(opts: EvalOptions, specs: list[BenchSpec]) -> dict:
    """`opts` as the fingerprint sees them: what does not change an episode is left out (--benches: each
    bench has its own cache file; --out, --limit, --trials, --split: the cache is per task and trial) or
    set to its default where no selected bench uses it (the user simulator, the judge and the endpoints'
    model name, --max-steps, --protocol), --rehearsal in its canonical spelling (`parse_rehearsal`), and
    --overrides without its ``store`` settings (where files go). Raises `EnvaceError` for a bad --rehearsal."""
    use = uses(opts, specs)
    defaults = EvalOptions(model="", benches="", out="")
    keep = {k: v for k, v in asdict(opts).items() if k not in ("benches", "out", "limit", "trials", "split")}
    mode, n = parse_rehearsal(opts.rehearsal)  # ' parallel:2' and 'parallel:02' are parallel:2's episodes
    keep["rehearsal"] = mode if mode == "none" else f"{mode}:{n}"
    unused = set()
    if not use["user"]:
        unused |= {"user_model", "user_url", "user_max_new_tokens"}
    if not use["judge"]:
        unused |= {"judge_model", "judge_url"}
    if not ((keep["user_url"] and use["user"]) or (keep["judge_url"] and use["judge"])):
        unused.add("user_url_model")
    if not use["tau2_user"]:
        unused.add("max_steps")
    if not use["tau2"]:
        unused.add("protocol")
    for k in unused:
        keep[k] = getattr(defaults, k)
    over = parse_overrides(opts.overrides)
    if "store" in over:  # the string as given otherwise, so that caches made before stay valid
        over.pop("store")
        keep["overrides"] = json.dumps(over, sort_keys=True) if over else ""
    return keep


def fingerprint(opts: EvalOptions, cfg: RunConfig, model: ResolvedModel, specs: list[BenchSpec] | None = None) -> str:
    """sha256 (16 hex) of the settings that change episodes: `_episode_options` of `opts` (`specs`: its
    parsed --bench, parsed here when not given), the model's registry version or its adapter folder's
    content, and the config sections an episode reads (model, data, rollout, rehearsal, eval; not
    ``eval.concurrency``: it batches episodes together, and each call keeps its own seeds).
    Raises `BenchSpecError` when `specs` is not given and --bench does not parse."""
    keep = _episode_options(opts, parse_benches(opts.benches) if specs is None else specs)
    keep["model_version"] = (model.manifest or {}).get("version")
    if model.adapter_dir and model.manifest is None:  # a local adapter folder: its content, not its path
        from envace_core.store.files import dir_checksums

        keep["adapter_sha256"] = hashlib.sha256(json.dumps(dir_checksums(model.adapter_dir),
                                                           sort_keys=True).encode()).hexdigest()
    keep["config"] = {k: cfg.to_dict()[k] for k in ("model", "data", "rollout", "rehearsal", "eval")}
    keep["config"]["eval"].pop("concurrency", None)  # how episodes are batched, not what they sample
    return hashlib.sha256(json.dumps(keep, sort_keys=True, default=str).encode()).hexdigest()[:16]
