"""Data and quality gates (great-expectations): the curated dataset gate and the rehearsal-quality gate."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    pass
import html
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from envace_core import EnvaceError


class DataLeakError(EnvaceError):
    """A test-split task would enter the training data."""


class GateError(EnvaceError):
    """A validation gate failed: the model must not be registered."""

os.environ["GX_ANALYTICS_ENABLED"] = "False"  # before great_expectations is imported anywhere

DATASET_COLUMNS = ("id", "domain", "split", "first_user_message", "user_scenario", "gold_actions",
                   "source")
TRANSITION_COLUMNS = ("fidelity", "json_valid", "parse_error", "error_match", "key_f1", "value_f1")


class GateFailed(GateError):
    """A great-expectations gate failed; the message lists every failed expectation.

    `.result` is the `GateResult` (render it with `render_gate_html`); `.artifact` is the store
    key its JSON was saved under, when it was saved.
    """

    def __init__(self, result: GateResult, artifact: str | None = None):
        self.result, self.artifact = result, artifact
        where = f"; results in {artifact}" if artifact else ""
        super().__init__(f"{result.name} gate failed ({len(result.failed)} of "
                         f"{len(result.checks)} expectations){where}:\n  - "
                         + "\n  - ".join(result.failed))


class DataLeakGateFailed(GateFailed, DataLeakError):
    """The dataset gate failed on (at least) test-split ids in the training data."""


@dataclass
class GateResult:
    name: str  # "dataset" | "rehearsal"
    success: bool
    failed: list[str]  # "description: expectation_type(column=…): observed …", one per failure
    checks: dict[str, bool]  # expectation description -> passed (recorded in the lineage manifest)
    results: dict[str, Any]  # GX ExpectationSuiteValidationResult.to_json_dict(), JSON-safe
    seconds: float = 0.0  # wall time of the gate (GX import, if first, included)
    error: type[GateFailed] = field(default=GateFailed, repr=False)

    def raise_if_failed(self, artifact: str | None = None) -> GateResult:
        if not self.success:
            raise self.error(self, artifact)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "success": self.success, "failed": self.failed,
                "checks": self.checks, "seconds": self.seconds, "results": self.results}


# ------------------------------------------------------------------------------------------ GX core
def _gx():
    import great_expectations as gx

    for name in ("great_expectations", "great_expectations.core", "great_expectations.data_context"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return gx


def _context():
    """An ephemeral (in-memory) GX context: no analytics, no progress bars, no data docs sites."""
    gx = _gx()
    from great_expectations.data_context.types.base import (
        DataContextConfig,
        InMemoryStoreBackendDefaults,
        ProgressBarsConfig,
    )

    cfg = DataContextConfig(analytics_enabled=False, progress_bars=ProgressBarsConfig(globally=False),
                            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False))
    return gx.get_context(mode="ephemeral", project_config=cfg)


def _json_safe(obj: Any) -> Any:
    """NaN/inf -> None, numpy scalars -> Python, so the result is strict JSON."""
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item") and not isinstance(obj, (str, bytes)):
        try:
            obj = obj.item()
        except (ValueError, AttributeError):
            return str(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


def _short(v: Any, n: int = 160) -> str:
    s = json.dumps(v, default=str) if not isinstance(v, str) else v
    return s if len(s) <= n else s[: n - 1] + "…"


def _describe_failure(r: dict[str, Any], df: pd.DataFrame) -> str:
    cfg, res = r["expectation_config"], r.get("result") or {}
    kw = {k: v for k, v in cfg["kwargs"].items() if k not in ("batch_id", "result_format")}
    column = kw.pop("column", None)
    if "value_set" in kw and len(kw["value_set"]) > 5:
        kw["value_set"] = f"<{len(kw['value_set'])} values>"
    args = ", ".join([f"column={column}"] * (column is not None) + [f"{k}={v}" for k, v in kw.items()])
    head = f"{cfg.get('description') or cfg['type']}: {cfg['type']}({args})"
    exc = r.get("exception_info") or {}
    if exc.get("raised_exception"):
        return f"{head}: error: {_short(exc.get('exception_message'))}"
    if "observed_value" in res:
        return f"{head}: observed {_short(res['observed_value'])}"
    if "unexpected_count" in res:
        idx = res.get("partial_unexpected_index_list") or []
        ids = [df["id"].iloc[i] for i in idx if "id" in df.columns and isinstance(i, int) and i < len(df)]
        rows = f" (ids {_short(ids, 200)})" if ids and column != "id" else ""
        return (f"{head}: {res['unexpected_count']} of {res.get('element_count')} rows unexpected, "
                f"e.g. {_short(res.get('partial_unexpected_list', [])[:5])}{rows}")
    if cfg["type"] == "expect_column_to_exist":
        return f"{head}: column missing"
    return f"{head}: failed"


def _run_suite(name: str, df: pd.DataFrame, expectations: list) -> GateResult:
    """Validate `df` against `expectations` (each with a unique `description`) in a fresh context."""
    gx = _gx()
    ctx = _context()
    batch = (ctx.data_sources.add_pandas(f"envace-{name}").add_dataframe_asset(name)
             .add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": df}))
    suite = gx.ExpectationSuite(name=f"envace-{name}", expectations=expectations)
    res = batch.validate(suite, result_format={"result_format": "SUMMARY", "partial_unexpected_count": 10})
    raw = _json_safe(res.to_json_dict())
    # GX orders results by its own plan; report them in suite order, keyed by description
    order = {e.description: i for i, e in enumerate(expectations)}
    raw["results"].sort(key=lambda r: order.get(r["expectation_config"].get("description"), 1 << 30))
    checks = {r["expectation_config"]["description"]: bool(r["success"]) for r in raw["results"]}
    failed = [_describe_failure(r, df) for r in raw["results"] if not r["success"]]
    return GateResult(name=name, success=bool(raw["success"]), failed=failed, checks=checks, results=raw)


# ------------------------------------------------------------------------------------ dataset gate
def _gold_actions_json_ok(text: Any) -> bool:
    try:
        actions = json.loads(text)
    except (TypeError, ValueError):
        return False
    return isinstance(actions, list) and all(
        isinstance(a, dict) and isinstance(a.get("name"), str) and isinstance(a.get("arguments", {}), dict)
        for a in actions)


def _domain_tools(domains: Iterable[str]) -> dict[str, dict[str, Any]]:
    """{domain: {tool name: JSON-schema parameters}} from the benchmark's own tool definitions."""
    from envace_core.envs.tau2.tasks import domain_static

    out = {}
    for d in domains:
        try:
            out[d] = {t.name: t.parameters for t in domain_static(d)[0]}
        except Exception:  # noqa: BLE001  (unknown domain: its rows fail the tool check)
            out[d] = {}
    return out


def _schema_ok(schema: Any) -> bool:
    from jsonschema import Draft202012Validator, SchemaError

    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        return False
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError:
        return False
    return True


def _added_tools(text: Any) -> dict[str, Any] | None:
    """{name: parameters} of a row's `tools_added` JSON ([] when absent or NaN); None if malformed."""
    if not isinstance(text, str) or not text:
        return {}
    try:
        specs = json.loads(text)
    except ValueError:
        return None
    if not isinstance(specs, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str)
                                              for s in specs):
        return None
    return {s["name"]: s.get("parameters", {"type": "object", "properties": {}}) for s in specs}


def _tool_calls_ok(domain: Any, text: Any, tools: Mapping[str, Mapping[str, Any]],
                   schema_ok: Mapping[str, Mapping[str, bool]], added: Any = None) -> bool:
    """Gold actions parse and call tools of `domain`, or of the row's `added` tools (tool learning:
    `tools_added` JSON; an added tool replaces the domain tool of its name), with valid arguments."""
    from jsonschema import Draft202012Validator

    extra = _added_tools(added)
    if not _gold_actions_json_ok(text) or domain not in tools or extra is None:
        return False
    if not all(schema_ok[domain].values()) or not all(_schema_ok(s) for s in extra.values()):
        return False
    specs = {**tools[domain], **extra}
    for a in json.loads(text):
        spec = specs.get(a["name"])
        if spec is None or next(Draft202012Validator(spec).iter_errors(a.get("arguments", {})), None):
            return False
    return True


def dataset_gate(df: pd.DataFrame, test_ids: Iterable[str], min_rows: int = 1,
                 max_rows: int | None = None, *, train_split: str = "train",
                 test_split: str = "test", domains: Iterable[str] | None = None,
                 tools: Mapping[str, Mapping[str, Any]] | None = None,
                 extra_splits: Iterable[str] = ()) -> GateResult:
    """Validate the curated task table `df` (one row per task, train and test rows together).

    `test_ids`: every id of the benchmark's test split (not only the ones kept), for the leakage
    check. `min_rows`/`max_rows` bound the number of rows (None: no upper bound). `domains`: the
    allowed domains (default: any). `tools`: {domain: {tool name: JSON-schema parameters}}
    (default: the tau2 domains' own tools). An optional `tools_added` column (JSON list of tool
    specs, `stages._task_record`; tool learning) adds its row's tools, whose schemas must be valid
    too. `extra_splits`: other split names allowed besides train and test (e.g. the held-out
    synthesized tasks, `synth.HELDOUT_SPLIT`); they may be empty. Never raises on bad data: see
    `raise_if_failed()`.
    """
    t0 = time.perf_counter()
    gx = _gx()
    E = gx.expectations
    df = df.reset_index(drop=True).copy()
    have = set(df.columns)  # a missing column fails ExpectColumnToExist; its other checks are skipped

    def col(c: str) -> pd.Series:
        return df[c] if c in have else pd.Series([None] * len(df), dtype=object)

    doms = sorted({d for d in col("domain").dropna().unique() if isinstance(d, str)})
    tools = dict(tools) if tools is not None else _domain_tools(doms)
    schema_ok = {d: {n: _schema_ok(s) for n, s in specs.items()} for d, specs in tools.items()}
    df["gold_actions_json_ok"] = [bool(_gold_actions_json_ok(g)) for g in col("gold_actions")]
    df["tool_calls_valid"] = [bool(_tool_calls_ok(d, g, tools, schema_ok, a))
                              for d, g, a in zip(col("domain"), col("gold_actions"), col("tools_added"))]
    df["train_id"] = col("id").where(col("split") == train_split, None)
    test_ids = sorted({str(i) for i in test_ids})
    exp = [E.ExpectColumnToExist(column=c, description=f"column '{c}' exists")
           for c in DATASET_COLUMNS]
    exp += [E.ExpectColumnValuesToNotBeNull(column=c, description=f"{c} is never null")
            for c in ("id", "domain", "split", "first_user_message") if c in have]
    if "id" in have:
        exp.append(E.ExpectColumnValuesToBeUnique(column="id", description="id is unique"))
    if "split" in have:
        splits = [train_split, test_split, *extra_splits]
        exp += [E.ExpectColumnValuesToBeInSet(column="split", value_set=splits,
                                              description=f"split is one of {splits}" if extra_splits
                                              else f"split is '{train_split}' or '{test_split}'"),
                E.ExpectColumnDistinctValuesToContainSet(column="split", value_set=[train_split, test_split],
                                                         description="both splits are non-empty")]
    exp += [
        E.ExpectColumnValuesToNotBeInSet(column="train_id", value_set=test_ids,
                                         description="no test-split task in the training split"),
        E.ExpectColumnValuesToBeInSet(column="gold_actions_json_ok", value_set=[True],
                                      description="gold_actions parse as a JSON list of tool calls"),
        E.ExpectColumnValuesToBeInSet(column="tool_calls_valid", value_set=[True],
                                      description="gold actions are valid calls of valid tool schemas"),
        E.ExpectTableRowCountToBeBetween(min_value=min_rows, max_value=max_rows,
                                         description=f"{min_rows} <= tasks <= {max_rows or 'inf'}"),
    ]
    if domains is not None and "domain" in have:
        exp.append(E.ExpectColumnValuesToBeInSet(column="domain", value_set=sorted(domains),
                                                 description="domain is a configured domain"))
    out = _run_suite("dataset", df, exp)
    if not out.checks.get("no test-split task in the training split", True):
        out.error = DataLeakGateFailed
    out.seconds = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------------------------- rehearsal gate
def _threshold(thresholds: Any, name: str, default: float) -> float:
    if isinstance(thresholds, Mapping):
        return float(thresholds.get(name, default))
    return float(getattr(thresholds, name, default))


# (column, threshold name, permissive value, "min" | "max"): the rehearsal gate's mean checks, in order
REHEARSAL_CHECKS = (
    ("fidelity", "min_fidelity", 0.0, "min"),
    ("json_valid", "min_json_validity", 0.0, "min"),
    ("parse_error", "max_parse_error_rate", 1.0, "max"),
    ("error_match", "min_error_accuracy", 0.0, "min"),
    ("key_f1", "min_key_f1", 0.0, "min"),
    ("value_f1", "min_value_f1", 0.0, "min"),
)
_LABEL = {"json_valid": "json_validity", "parse_error": "parse_error_rate", "error_match": "error_accuracy"}


def gate_thresholds(thresholds: Any) -> dict[str, Any]:
    """{threshold name: value} of the rehearsal gate (`REHEARSAL_CHECKS`; a name `thresholds` lacks
    takes its permissive value), plus "active": whether any is stricter than permissive."""
    out: dict[str, Any] = {name: _threshold(thresholds, name, free) for _, name, free, _ in REHEARSAL_CHECKS}
    out["active"] = any(out[name] != free for _, name, free, _ in REHEARSAL_CHECKS)
    return out


def rehearsal_gate(rows: pd.DataFrame | Iterable[Mapping[str, Any]], thresholds: Any) -> GateResult:
    """Validate rehearsal quality from one row per held-out transition.

    Row columns (`TRANSITION_COLUMNS`, each in [0, 1], `stages.validate.rehearse_rows`): `fidelity`
    (F(ô, o); 0 for an unparseable ô), `json_valid` (1/0: ô is one JSON value), `parse_error` (1/0:
    the strict REHEARSE parser rejected ô, empty included), `error_match` (1/0: ô is an error iff o
    is), `key_f1` and `value_f1` (`evaluation.fidelity`). `thresholds`: a `ValidateConfig` or mapping
    with `min_fidelity`, `min_json_validity`, `min_error_accuracy`, `min_key_f1`, `min_value_f1`
    (each a floor on the column's mean, default 0) and `max_parse_error_rate` (a ceiling, default 1).
    """
    t0 = time.perf_counter()
    gx = _gx()
    E = gx.expectations
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    for c in TRANSITION_COLUMNS:
        if c not in df.columns:
            df[c] = pd.Series(dtype=float)
    for c in TRANSITION_COLUMNS:
        df[c] = pd.to_numeric(df[c], errors="coerce").astype(float)
    if "id" not in df.columns:
        df["id"] = [f"transition-{i}" for i in range(len(df))]
    th = gate_thresholds(thresholds)
    exp = [
        E.ExpectTableRowCountToBeBetween(min_value=1, description="at least one held-out transition"),
        *[E.ExpectColumnValuesToNotBeNull(column=c, description=f"{c} is never null")
          for c in TRANSITION_COLUMNS],
        *[E.ExpectColumnValuesToBeBetween(column=c, min_value=0.0, max_value=1.0, description=f"{c} in [0, 1]")
          for c in ("fidelity", "key_f1", "value_f1")],
    ]
    for col, name, _, side in REHEARSAL_CHECKS:
        label = _LABEL.get(col, col)
        if side == "min":
            exp.append(E.ExpectColumnMeanToBeBetween(column=col, min_value=th[name],
                                                     description=f"{label} >= {th[name]:.3f}"))
        else:
            exp.append(E.ExpectColumnMeanToBeBetween(column=col, max_value=th[name],
                                                     description=f"{label} <= {th[name]:.3f}"))
    out = _run_suite("rehearsal", df, exp)
    out.seconds = time.perf_counter() - t0
    return out


# ------------------------------------------------------------------------------------------ render
def render_gate_html(result: GateResult | Mapping[str, Any]) -> str:
    """A self-contained HTML summary (for a Flyte Deck): one table row per expectation.

    `result`: a `GateResult`, its `to_dict()`, or the raw GX results dict (e.g. a saved gate.json).
    """
    if isinstance(result, GateResult):
        result = result.to_dict()
    raw = result.get("results", result)
    name = result.get("name") or raw.get("suite_name", "gate")
    ok = bool(raw.get("success"))
    stats = raw.get("statistics", {})
    colour = "#1a7f37" if ok else "#cf222e"
    rows = []
    for r in raw.get("results", []):
        cfg, res = r["expectation_config"], r.get("result") or {}
        kw = {k: v for k, v in cfg.get("kwargs", {}).items() if k != "batch_id"}
        if "value_set" in kw and len(kw["value_set"]) > 5:
            kw["value_set"] = f"<{len(kw['value_set'])} values>"
        if (r.get("exception_info") or {}).get("raised_exception"):
            observed = "error: " + str(r["exception_info"].get("exception_message"))
        elif "observed_value" in res:
            observed = _short(res["observed_value"])
        elif "unexpected_count" in res:
            observed = (f"{res['unexpected_count']} unexpected of {res.get('element_count')}"
                        + (f": {_short(res.get('partial_unexpected_list', [])[:5])}"
                           if res["unexpected_count"] else ""))
        else:
            observed = ""
        mark = "✅" if r["success"] else "❌"
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in (
            mark, cfg.get("description") or "", cfg["type"], _short(kw, 200), observed)) + "</tr>")
    return (f"<div class='envace-gate'><h3>{html.escape(str(name))} gate: "
            f"<span style='color:{colour}'>{'PASSED' if ok else 'FAILED'}</span></h3>"
            f"<p>{stats.get('successful_expectations', '?')} of {stats.get('evaluated_expectations', '?')}"
            f" expectations met (great-expectations {html.escape(str(raw.get('meta', {}).get('great_expectations_version', '')))})</p>"
            "<table border='1' cellpadding='4' style='border-collapse:collapse'>"
            "<tr><th></th><th>expectation</th><th>type</th><th>kwargs</th><th>observed</th></tr>"
            + "".join(rows) + "</table></div>")
