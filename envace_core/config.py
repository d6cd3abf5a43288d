"""Run configuration: pydantic models, named profiles, and strict loading with clear errors.

Config is data, not code paths: every stage reads one `RunConfig`. Unknown keys are rejected, so a
typo in an override fails loudly instead of being ignored.

The models (`RunConfig`, its sections, `location`) are defined in `envace_core.config_sections`
and override parsing (`parse_overrides`, `ConfigError`) in `envace_core.config_text`, both
re-exported here; this module holds the profiles, `load_config`, `apply_setting` and the README's
configuration table.
"""

from __future__ import annotations

import inspect
import json
import re
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from envace_core.config_checks import PLACEHOLDER, ItemError, location
from envace_core.config_sections import (
    KNOWN_DOMAINS,
    REHEARSE_TOKENS_PER_TOOL,
    DataConfig,
    EvalConfig,
    ModelConfig,
    RehearsalConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    StoreConfig,
    TrainConfig,
    ValidateConfig,
)
from envace_core.config_text import ConfigError, expand_dotted, parse_overrides

__all__ = [
    "CONFIG_TABLE_BEGIN",
    "CONFIG_TABLE_END",
    "KNOWN_DOMAINS",
    "PLACEHOLDER",
    "PROFILES",
    "REHEARSE_TOKENS_PER_TOOL",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "RehearsalConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "StoreConfig",
    "TrainConfig",
    "ValidateConfig",
    "apply_setting",
    "config_from_json",
    "config_table_markdown",
    "deep_merge",
    "expand_dotted",
    "load_config",
    "location",
    "parse_overrides",
]


PROFILES: dict[str, dict[str, Any]] = {
    # The README's main job: real tau2 airline+retail tasks, the bundled 135M model, 2 CPU cores.
    "cpu-smoke": {
        "data": {
            "domains": ["airline", "retail"],
            # the curriculum: synthesized levels 1-3 (one look-up; one write; a look-up then a write)
            # plus 10 tau2 train tasks per domain. 40 distinct synthesized tasks, not 10, at the same SFT
            # steps: held-out first ACT call +0.20 [+0.07, +0.37] (ACT-only pass) and the main job's
            # rehearser JSON validity 19/24 vs 14/24 (RESULTS.md "Four times the synthesized train tasks",
            # "The default curriculum with 80 synthesized tasks")
            "max_train_tasks_per_domain": 10,
            "synthetic_tasks_per_domain": 40,
            # + 3 synthesized tasks per domain (one per level) held out: the evaluate stage compares
            # base, warm start and trained policy on them and on the test tasks
            "synthetic_heldout_per_domain": 3,
            "max_test_tasks_per_domain": 3,
            "policy_max_chars": 1200,
        },
        # REHEARSE budgets per tool (the config default, REHEARSE_TOKENS_PER_TOOL: each tool's p95 real
        # result or longest wrong-call error, up to 956 tokens; ≤ ~980 per imagined 3-call trajectory,
        # generation stops at the eos); 64 tokens for a tool not in that table
        # T = 0.7: after the warm start, 38 % of first ACT turns on synthesized tasks are a parseable
        # call at 0.7 against 8 % at 1.0 (RESULTS.md "Signal"); rollouts need a mix to compare
        # max_turns 5: a level-3 synthesized task needs up to 4 calls and the answer; 128 ACT tokens: 5 of
        # the 86 gold calls of the curriculum's first 3 turns are 94-131 tokens (a 64-token cut is a parse error)
        "rollout": {"group_size": 4, "tasks_per_iteration": 3, "max_turns": 5, "temperature": 0.7,
                    "max_new_tokens_act": 128, "max_new_tokens_rehearse": 64},
        # imagined trajectories are scored in the world REHEARSE showed ACT (README "Roles, rewards"), and
        # REHEARSE rows get R + 0.5·F: with R alone a group whose trajectories all fail gives both roles
        # no advantage; with the fidelity term REHEARSE still learns from its replayed real results
        # (frac_zero_std 0.75 -> 0.50 in iteration 2 of two runs' rollouts; ≤ 0.5 in every iteration of the one
        # main job trained with it; RESULTS.md "A fidelity term for REHEARSE")
        "reward": {"name": "consistent", "fidelity_lambda": 0.5},
        # the warm_start stage: 30 SFT steps of 8 rows (each batch from one role x domain system
        # message), ACT on gold turns and REHEARSE on real transitions together (≈ 21 min on 2 AVX2
        # cores, once: re-runs reuse it). format_penalty: a trajectory ended by an unparseable output
        # scores below a clean wrong one, so groups that mix the two have a signal
        "train": {"iterations": 3, "sft_warmup_steps": 30, "sft_batch_rows": 8, "sft_learning_rate": 5e-4,
                  "format_penalty": -0.5},
        "rehearsal": {"mode": "parallel", "n": 2},
        "eval": {"max_turns": 5},
        # The rehearsal gate: 24 held-out transitions whose real result fits the tool's REHEARSE budget
        # (12 wrong-call errors, 12 successes), thresholds = 95 % lower bounds (benchmarks/gate_calibration.py's
        # rule; RESULTS.md "Rehearsal gate") of the policy trained from this profile's warm start (the
        # 2026-12-02 run): JSON validity 10/24, error-vs-success 5/24, key F1 0.17; the base model ~0 on all
        "validate": {"max_transitions": 24, "fit_budget": True, "min_json_validity": 0.2,
                     "max_parse_error_rate": 0.8, "min_error_accuracy": 0.05, "min_key_f1": 0.05},
    },
    # Tests: one task, one step, tiny generations. The model ref is set by the test fixture.
    "test": {
        "data": {"domains": ["airline"], "max_train_tasks_per_domain": 1,
                 "max_test_tasks_per_domain": 1, "policy_max_chars": 300, "dvc": "off"},
        "rollout": {"group_size": 2, "tasks_per_iteration": 1, "max_turns": 1,
                    "max_new_tokens_act": 8, "max_new_tokens_rehearse": 8, "max_new_tokens_rehearse_per_tool": {}},
        "train": {"iterations": 1, "micro_batch_rows": 8},
        "rehearsal": {"mode": "parallel", "n": 2, "memory_max_tokens": 32},
        "eval": {"max_turns": 1, "compare": []},
        "validate": {"max_transitions": 2},
    },
    # A GPU cluster run with an 8B model given by path or s3:// URI.
    "gpu-8b": {
        "model": {"ref": "s3://CHANGE-ME/models/Qwen3-8B"},
        "data": {"domains": ["airline", "retail", "telecom"], "dvc_remote": "s3://CHANGE-ME/envace/dvc"},
        "rollout": {"group_size": 8, "tasks_per_iteration": 16, "max_turns": 12, "engine": "vllm",
                    "max_new_tokens_act": 512, "max_new_tokens_rehearse": 512},
        "reward": {"name": "consistent"},
        "train": {"iterations": 50, "learning_rate": 1e-6, "micro_batch_rows": 8, "micro_batch_tokens": None},
        "rehearsal": {"mode": "parallel", "n": 4, "memory_max_tokens": 1024},
        "eval": {"max_turns": 30, "protocol": "tau2_orchestrator"},
        "validate": {"max_transitions": 200, "min_json_validity": 0.9, "min_fidelity": 0.5,
                     "max_parse_error_rate": 0.1},
        # On a cluster every stage is its own pod: placeholders that resolve_config refuses until
        # an operator sets real blob-store URIs (README, Operators).
        "store": {"root": "s3://CHANGE-ME/envace/store", "registry": "s3://CHANGE-ME/envace/registry"},
    },
}


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(profile: str = "cpu-smoke", overrides: str | dict[str, Any] | None = None) -> RunConfig:
    """Resolve a profile plus overrides into a validated `RunConfig`.

    Raises:
        ConfigError: unknown profile, unparseable overrides, unknown keys or out-of-range values.
    """
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; choose one of {sorted(PROFILES)}")
    over = parse_overrides(overrides)
    if "profile" in over and over["profile"] != profile:
        raise ConfigError(f"overrides set profile={over['profile']!r}, but the profile is chosen with "
                          f"--profile (this run: {profile!r}); drop 'profile' from the overrides")
    merged = deep_merge({"profile": profile, **PROFILES[profile]}, over)
    try:
        return RunConfig.model_validate(merged)
    except ValidationError as e:
        lines = [f"  {_error_line(err)}" for err in e.errors()]
        raise ConfigError("invalid configuration:\n" + "\n".join(lines) +
                          "\nFix the override (see README 'Configuration').") from None


def apply_setting(cfg: RunConfig, key: str, value: str, flag: str) -> None:
    """Set the dotted setting `key` (e.g. ``model.ref``) of `cfg` to `value`, given by the command-line
    flag `flag`, through the setting's own checks (the models validate assignments).

    Raises:
        ConfigError: `value` is empty or blank (``--model is empty``), or the setting refuses it; the
            message names `flag` and `key`.
    """
    if not value.strip():
        raise ConfigError(f"{flag} is empty: give a value for {key}, or leave {flag} out to keep the config's")
    *path, leaf = key.split(".")
    node: BaseModel = cfg
    for part in path:
        node = getattr(node, part)
    try:
        setattr(node, leaf, value)
    except ValidationError as e:
        why = "; ".join(_error_line({**err, "loc": ()}) for err in e.errors())
        raise ConfigError(f"{flag} {value!r} (the setting {key}): {why}") from None


def _error_line(err: dict[str, Any]) -> str:
    """One pydantic error as 'key: message', a list item's key with its position (data.synthetic_levels[1]);
    an unknown key with the closest known one (`_unknown_key`); a string field given a number or boolean (by a
    JSON file or a dict: YAML text keeps what was typed) says to write it as a JSON string, one given a list
    to give one value."""
    key = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    msg = err["msg"].removeprefix("Value error, ")
    item = (err.get("ctx") or {}).get("error")
    if isinstance(item, ItemError):  # a list item's or mapping value's problem: name its position
        key, msg = key + item.at, item.reason
    value = err.get("input")
    if err["type"] == "extra_forbidden":
        msg = _unknown_key(err["loc"])
    if err["type"] == "string_type" and isinstance(value, (bool, int, float)):
        kind = "boolean" if isinstance(value, bool) else "number"
        msg = f'expects a string, but was given the {kind} {value!r}: write it in double quotes, e.g. "{value}"'
    elif err["type"] == "string_type" and isinstance(value, (list, tuple)):
        msg = f"expects one string, but was given the list {value!r}: give a single value (no [ ])"
    return f"{key}: {msg}" if key else msg


def _unknown_key(loc: tuple) -> str:
    """The message for a setting no section has at `loc` (a pydantic error location): the closest known
    name (`difflib`, as for tool names) or the section's settings."""
    import difflib

    model: type[BaseModel] = RunConfig
    for part in loc[:-1]:
        fields = {f.alias or n: f for n, f in model.model_fields.items()}  # what a user writes: validate, not validate_
        field = fields.get(part) if isinstance(part, str) else None
        if field is None or not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
            return "unknown setting"
        model = field.annotation
    names = sorted(f.alias or n for n, f in model.model_fields.items())
    where = ".".join(map(str, loc[:-1]))
    close = difflib.get_close_matches(str(loc[-1]), names, n=1)
    if close:
        return f"unknown setting; did you mean {'.'.join([*map(str, loc[:-1]), close[0]])}?"
    if len(loc) == 1:  # a setting's name without its section (init_adapter=... for train.init_adapter)
        owners = [f"{sec.alias or n}.{loc[0]}" for n, sec in RunConfig.model_fields.items()
                  if isinstance(sec.annotation, type) and issubclass(sec.annotation, BaseModel)
                  and loc[0] in {f.alias or k for k, f in sec.annotation.model_fields.items()}]
        if owners:
            return f"unknown setting; did you mean {' or '.join(owners)}? (settings are written SECTION.NAME)"
    return f"unknown setting; {where or 'the config'} has: {', '.join(names)}"


def config_from_json(text: str) -> RunConfig:
    """Rebuild a resolved config passed between pipeline stages as JSON."""
    return RunConfig.model_validate(json.loads(text))


# ------------------------------------------------------------------ the README's configuration table
CONFIG_TABLE_BEGIN = "<!-- config-table:begin -->"
CONFIG_TABLE_END = "<!-- config-table:end -->"


def _yaml_value(v: Any) -> str:
    """`v` as an override spells it (YAML flow style): null, true, [a, b], {k: v}."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return "[" + ", ".join(_yaml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _type_text(annotation: Any) -> str:
    """A field's type in words: `a` / `b` for a Literal, 'int or null', 'list of str', 'mapping'."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " / ".join(f"`{_yaml_value(a)}`" for a in args)
    if origin in (Union, UnionType):
        kept = [a for a in args if a is not type(None)]
        return " or ".join(_type_text(a) for a in kept) + (" or null" if len(kept) < len(args) else "")
    if origin is list:
        return f"list of {_type_text(args[0])}"
    if origin is dict:
        return "mapping"
    return "any" if annotation is Any else annotation.__name__


def _bounds_text(field: FieldInfo) -> str:
    """The field's range constraints, e.g. '≥ 1', '> 0, ≤ 1', 'non-empty'."""
    signs = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    out = []
    for m in field.metadata:
        out += [f"{sign} {getattr(m, name)}" for name, sign in signs.items() if hasattr(m, name)]
        if getattr(m, "min_length", None):
            out.append("non-empty")
    return ", ".join(out)


def _cell(text: str) -> str:
    """`text` as one markdown table cell: one line, pipes escaped, and outside code spans a `<` that
    would open an HTML tag (`<registry>`) written `&lt;`."""
    parts = " ".join(text.split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else re.sub(r"<(?=[A-Za-z/!?])", "&lt;", p) for i, p in enumerate(parts))


def _section_doc(model: type[BaseModel]) -> str:
    return " ".join(inspect.cleandoc(model.__doc__ or "").split())


def config_table_markdown() -> str:
    """Every `RunConfig` field as one markdown table: setting (dotted override key), type and range,
    default, the profiles that change it, and its description (the README's configuration table,
    between `CONFIG_TABLE_BEGIN` and `CONFIG_TABLE_END`; `envace config --markdown` prints it).

    Defaults and profile values are written as overrides spell them (YAML: null, true, [a, b]).
    """
    defaults = RunConfig().to_dict()
    resolved = {p: load_config(p).to_dict() for p in PROFILES}
    rows = ["| setting | type | default | profiles | meaning |", "|---|---|---|---|---|"]

    def row(key: str, field: FieldInfo, default: Any, in_profiles: dict[str, Any]) -> str:
        kind = ", ".join(x for x in (_type_text(field.annotation), _bounds_text(field)) if x)
        changed = "; ".join(f"{p}: `{_yaml_value(v)}`" for p, v in in_profiles.items() if v != default)
        default_text = _yaml_value(default).replace("|", "\\|")
        return f"| `{key}` | {_cell(kind)} | `{default_text}` | {_cell(changed)} | {_cell(field.description or '')} |"

    for name, field in RunConfig.model_fields.items():
        key = field.alias or name
        section = field.annotation
        if not (isinstance(section, type) and issubclass(section, BaseModel)):
            rows.append(row(key, field, defaults[key], {}))  # `profile`: each profile names itself
            continue
        rows.append(f"| **`{key}`** | | | | {_cell(_section_doc(section))} |")
        for sub, sub_field in section.model_fields.items():
            rows.append(row(f"{key}.{sub}", sub_field, defaults[key][sub],
                            {p: cfg[key][sub] for p, cfg in resolved.items()}))
    return "\n".join(rows)
