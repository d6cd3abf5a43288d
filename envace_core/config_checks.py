"""Checks of single configuration values and of settings that depend on each other, run by the
validators of the section models (`envace_core.config_sections`) when a config loads: storage
locations, registry names, repeated list items, tool names of the configured domains, and the
combinations of rollout and train settings that would silently train nothing; also the type
rules shared with override parsing (`scalar_kinds`, `plain_number`): a number setting takes a plain
decimal, never a boolean.

Each check raises ValueError naming the setting and what to type instead; pydantic turns it into
the `config.ConfigError` that `config.load_config` raises. `UnusedSettingWarning` is warned for a
setting that is legal but probably a typo.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import warnings
from types import UnionType
from typing import (
    Annotated,
    Any,
    Iterable,
    Literal,
    Mapping,
    Union,
    get_args,
    get_origin,
)

BUNDLED_MODEL = "bundled:smollm2-135m-instruct"  # the one model shipped with envace (models.bundled_gguf_path)
PLACEHOLDER = "CHANGE-ME"  # what the profiles put where an operator must name their own bucket
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")  # S3 bucket naming rules (AWS S3 user guide)
# registry:NAME@VERSION; NAME and VERSION are each one folder of the registry (store.registry._check_ref)
_REGISTRY_REF = re.compile(r"registry:[^@\s/.][^@\s/]*@[^@\s/.][^@\s/]*")
_JOINED = re.compile(r"\s[\w.]+=")  # "s3://b/x train.iterations=5": two overrides joined by a space
# a registry name: one path segment of a local folder and of an S3 key, and the NAME of NAME@VERSION
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MODEL_NAME_MAX = 128  # characters of store.model_name (a folder name; see check_model_name)
OFF_WORDS = (False, "false", "False")  # JSON's false, and YAML's text for it (YAML 1.1 reads off as False)
DECIMAL_INT = re.compile(r"[-+]?(0|[1-9][0-9]*)")  # no leading 0 (YAML 1.1: octal), '_', 0x/0o/0b or ':'
DECIMAL_NUMBER = re.compile(r"[-+]?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_INF_NAN = re.compile(r"[-+]?\.?(?:inf|infinity|nan)", re.IGNORECASE)  # refused by the models' allow_inf_nan


class UnusedSettingWarning(UserWarning):
    """A setting that loads but has no effect as configured (e.g. a budget for a tool no domain has)."""


def location(value: Any, setting: str, schemes: tuple[str, ...] = ()) -> Any:
    """Check a storage location setting: an ``s3://bucket/prefix`` URI (bucket per S3's naming rules,
    no whitespace, no empty path segment), a local path, or ``<scheme>:...`` for a scheme in
    `schemes` (e.g. "bundled", "registry"). Raises ValueError naming `setting` for another scheme
    (``S3://``, ``hf://``, ``s3:/x``), a malformed S3 URI, an empty or blank string, two overrides
    joined by a space, or a mapping (YAML reads ``registry: NAME@VERSION``, a space after the colon, as
    {"registry": "NAME@VERSION"}), or a ``~user`` path of a user this machine does not know. Returns the value, a
    local path's leading ``~`` / ``~user`` expanded. Other non-strings are returned as they are, for the field's
    type check."""
    if isinstance(value, dict):
        if all(v is None for v in value.values()):  # `registry:` alone: YAML's key with no value
            e_g = "registry:NAME@VERSION, " if "registry" in schemes else \
                f"{BUNDLED_MODEL}, " if "bundled" in schemes else ""
            raise ValueError(f"{setting}={next(iter(value), '')}: names nothing after the colon: write e.g. "
                             f"{e_g}an s3:// URI or a local path")
        shown = ", ".join(f"{k}: {v}" for k, v in value.items())
        raise ValueError(f"{setting} was read as a mapping ({shown}), not a location: YAML splits a value at "
                         "': ', so write it without a space after the colon (e.g. registry:NAME@VERSION)")
    if not isinstance(value, str):
        return value
    if not value.strip():
        raise ValueError(f"{setting} is empty: give a local path or s3://BUCKET/PREFIX"
                         + "".join(f", or {x}:..." for x in schemes))
    if _JOINED.search(value):
        raise ValueError(f"{setting}={value!r} holds another override after a space: separate overrides "
                         "with commas (a.b=x,c.d=y)")
    if value.startswith("s3://"):
        bucket, _, key = value[len("s3://"):].partition("/")
        if PLACEHOLDER in bucket:  # a profile's placeholder: preflight refuses it, naming what to set
            return value
        if not _BUCKET.match(bucket) or any(c.isspace() for c in value) or key.startswith("/") or "//" in key:
            why = f"; the bucket {bucket!r} has {len(bucket)} characters" if not 3 <= len(bucket) <= 63 else ""
            raise ValueError(f"{setting}={value!r} is not a valid S3 URI: expected s3://BUCKET/PREFIX, BUCKET "
                             f"3-63 lowercase letters, digits, '.' or '-', no spaces or empty path segments{why}")
        return value
    m = _SCHEME.match(value)
    if m and m.group(1) == "bundled" and "bundled" in schemes and value != BUNDLED_MODEL:
        raise ValueError(f"{setting}={value!r} is an unknown bundled model: the only one is {BUNDLED_MODEL!r}")
    if m and m.group(1) == "registry" and "registry" in schemes and not _REGISTRY_REF.fullmatch(value):
        raise ValueError(f"{setting}={value!r} is malformed: write registry:NAME@VERSION, no spaces or '/', "
                         "neither part starting with '.' (see `envace registry list`)")
    if m and m.group(1) == "registry" and "registry" not in schemes and "bundled" in schemes:  # a model setting
        raise ValueError(f"{setting}={value!r}: registry:NAME@VERSION refs name a trained adapter and are read by "
                         f"train.init_adapter and `envace eval --model`; {setting} is a base model: "
                         + ", ".join(f"{x}:..." for x in schemes) + (", " if schemes else "")
                         + "a local HF model folder, or an s3:// URI (the version's manifest names its base_model)")
    if m and m.group(1) not in schemes:
        allowed = ", ".join(["s3://"] + [f"{x}:" for x in schemes])
        raise ValueError(f"{setting}={value!r} has the scheme {m.group(1)!r}, which envace does not read: "
                         f"use {allowed} or a local path")
    # a local path's ~ is expanded here, so the printed and recorded config names the folder the run uses
    if value.startswith("~") and not m:
        expanded = os.path.expanduser(value)
        if expanded.startswith("~"):
            raise ValueError(f"{setting}={value!r}: {value.split('/', 1)[0]} names no user with a home folder on "
                             "this machine: write the full path")
        return expanded
    return value


def off_word(value: Any) -> Any:
    """'off' for the boolean False (and the strings 'false' / 'False'), which is what YAML makes of a bare
    ``off`` in ``data.dvc=off``; any other value unchanged."""
    return "off" if any(value is w or (isinstance(w, str) and value == w) for w in OFF_WORDS) else value


def check_model_name(value: str, setting: str = "store.model_name") -> str:
    """Raises ValueError unless `value` is a registry name (`MODEL_NAME`): letters, digits, '.', '_' and '-',
    starting with a letter or digit (no '/', '@' or spaces), at most `MODEL_NAME_MAX` characters (the name is
    one folder of `<registry>/<name>/<version>/`, and filesystems refuse names over 255 bytes: checked here,
    not when the finished run registers)."""
    if not MODEL_NAME.fullmatch(value):
        raise ValueError(f"{setting}={value!r} is not a registry name: use letters, digits, '.', '_' and '-', "
                         "starting with a letter or digit (no '/', '@' or spaces), e.g. envace-policy")
    if len(value) > MODEL_NAME_MAX:
        raise ValueError(f"{setting} is {len(value)} characters long ({value[:40]}...): a registry name has at "
                         f"most {MODEL_NAME_MAX}")
    return value


def check_unique(values: list, setting: str) -> list:
    """Raises ValueError naming the items of `values` given more than once."""
    seen: set = set()
    repeated = [v for v in values if v in seen or seen.add(v)]
    if repeated:
        kept = list(dict.fromkeys(values))
        raise ValueError(f"{setting} lists {sorted(set(map(str, repeated)))} more than once: give each once, "
                         f"e.g. {setting}=[{','.join(map(str, kept))}]")
    return values


def domain_tool_names(domains: Iterable[str]) -> dict[str, list[str]]:
    """{domain: its tau2 tool names, sorted}; reads tau2's environments (a few seconds the first time)."""
    from envace_core.envs.tau2.tasks import domain_static

    return {d: sorted(t.name for t in domain_static(d)[0]) for d in domains}


def check_hidden_tools(hidden: list[str], domains: list[str]) -> None:
    """ValueError listing each configured domain's tools unless every hidden name is one of them.
    Reads the domains' tool lists from tau2 (a few seconds, only when data.hidden_tools is set)."""
    names = domain_tool_names(domains)
    unknown = sorted(set(hidden) - {n for ns in names.values() for n in ns})
    if unknown:
        listing = "; ".join(f"{d}: {', '.join(ns)}" for d, ns in names.items())
        raise ValueError(f"hidden_tools {unknown} are not tools of the configured domains ({listing})")


def check_splits(splits: Mapping[str, str], domains: list[str]) -> None:
    """ValueError naming each setting of `splits` ({"data.train_split": name, ...}) whose name is not a tau2
    split of every domain in `domains` (the package's split_tasks.json, `envs.tau2.tasks.valid_splits`),
    listing each domain's splits; so a typo fails at config load, not in curate. Reads tau2 (a few seconds)."""
    from envace_core.envs.tau2.tasks import valid_splits

    have = {d: valid_splits(d) for d in domains}
    bad = [f"{k}={v!r}" for k, v in splits.items() if any(v not in names for names in have.values())]
    if bad:
        listing = "; ".join(f"{d}: {', '.join(names)}" for d, names in have.items())
        raise ValueError(f"{', '.join(bad)} is not a tau2 split of every configured domain ({listing})")


def warn_unknown_budget_tools(budgets: Mapping[str, int], domains: list[str], known: Iterable[str]) -> None:
    """Warn (`UnusedSettingWarning`) for each tool named in rollout.max_new_tokens_rehearse_per_tool that is
    neither in `known` (the default table's tools) nor a tool of the configured domains: its budget applies
    only to a tool added under that name later (`envace adapt-tools`), so it is most likely a typo. Reads
    the domains' tools from tau2 only when such a name is present."""
    new = sorted(set(budgets) - set(known))
    if not new:
        return
    tools = {n for ns in domain_tool_names(domains).values() for n in ns} | set(known)
    for name in (n for n in new if n not in tools):
        close = difflib.get_close_matches(name, sorted(tools), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        warnings.warn(f"rollout.max_new_tokens_rehearse_per_tool names {name!r}, which is no tool of the "
                      f"configured domains ({', '.join(domains)}): its budget is used only if a tool of that "
                      f"name is added later (envace adapt-tools){hint}", UnusedSettingWarning, stacklevel=2)


# the imagined rehearsals ACT's memory warm-up examples are drawn from (rehearsal.memory_examples.KINDS)
ACT_MEMORY_KINDS = ("faithful", "imagined_error", "wrong_call")
MAX_ACT_REPEATS = 64  # train.sft_act_repeats: far past any useful ACT:REHEARSE mix; batch_order builds a pass up front


def mixes_roles(train: Any) -> bool:
    """Whether the SFT warm-up of `train` (a TrainConfig) trains one shared policy (not policy_per_role) on
    both ACT and REHEARSE examples (sft_warmup_steps > 0): the only warm-up whose ACT share
    train.sft_act_repeats and train.sft_act_final_steps change."""
    return train.sft_warmup_steps > 0 and not train.policy_per_role and {"act", "rehearse"} <= set(train.sft_roles)


def effective_act_repeats(train: Any) -> int:
    """train.sft_act_repeats where it changes the SFT warm-up (`mixes_roles`), else 1."""
    return train.sft_act_repeats if mixes_roles(train) else 1


def effective_act_final_steps(train: Any) -> int:
    """train.sft_act_final_steps where it changes the SFT warm-up (`mixes_roles`), else 0."""
    return train.sft_act_final_steps if mixes_roles(train) else 0


def warn_unused_act_settings(train: Any) -> None:
    """Warn (`UnusedSettingWarning`) for train.sft_act_repeats ≠ 1 or train.sft_act_final_steps ≠ 0 where
    they change nothing (`mixes_roles`), for train.sft_act_recovery, train.sft_act_memory or train.sft_answer_repeats ≠ 1 without
    ACT warm-up examples, and for train.sft_act_memory_kinds other than `ACT_MEMORY_KINDS` without train.sft_act_memory."""
    no_act = 'nothing (sft_warmup_steps=0)' if train.sft_warmup_steps == 0 else 'no ACT'
    for name, value, default in (("sft_act_recovery", train.sft_act_recovery, False),
                                 ("sft_act_memory", train.sft_act_memory, False),
                                 ("sft_answer_repeats", train.sft_answer_repeats, 1)):
        if value != default and (train.sft_warmup_steps == 0 or "act" not in train.sft_roles):
            warnings.warn(f"train.{name}={str(value).lower()} has no effect: it adds ACT warm-up examples, and this "
                          f"config warms {no_act}", UnusedSettingWarning, stacklevel=3)
    if not train.sft_act_memory and sorted(train.sft_act_memory_kinds) != sorted(ACT_MEMORY_KINDS):
        warnings.warn(f"train.sft_act_memory_kinds={train.sft_act_memory_kinds} has no effect: it picks the rehearsals "
                      "of train.sft_act_memory's examples, and train.sft_act_memory is false", UnusedSettingWarning,
                      stacklevel=3)
    if mixes_roles(train):
        return
    why = ("no policy (sft_warmup_steps=0)" if train.sft_warmup_steps == 0 else
           "each role's adapter on its own examples (policy_per_role)" if train.policy_per_role
           else f"only {train.sft_roles}")
    for name, value, default in (("sft_act_repeats", train.sft_act_repeats, 1),
                                 ("sft_act_final_steps", train.sft_act_final_steps, 0)):
        if value != default:
            warnings.warn(f"train.{name}={value} has no effect: it weighs ACT against REHEARSE examples of one "
                          f"shared policy, and this config warms {why}", UnusedSettingWarning, stacklevel=3)


def warn_unused_rehearsal_settings(rehearsal: Any) -> Any:
    """Warn (`UnusedSettingWarning`) for rehearsal.grounded_errors=true with the verifier off (it is one of the
    verifier's checks) and for rehearsal.prune_rejected=true set explicitly with the verifier off (it stops
    rehearsals the verifier rejects); returns `rehearsal` (a pydantic after-validator)."""
    if rehearsal.grounded_errors and not rehearsal.verifier:
        warnings.warn("rehearsal.grounded_errors=true has no effect: it is a verifier check, and rehearsal.verifier "
                      "is false", UnusedSettingWarning, stacklevel=3)
    if "prune_rejected" in rehearsal.model_fields_set and rehearsal.prune_rejected and not rehearsal.verifier:
        warnings.warn("rehearsal.prune_rejected=true has no effect: it stops rehearsals the verifier rejects, and "
                      "rehearsal.verifier is false", UnusedSettingWarning, stacklevel=3)
    return rehearsal


def warn_unused_constraint(rollout_constrained: bool, rehearsal_constrained: bool) -> None:
    """Warn (`UnusedSettingWarning`) for rehearsal.constrained_decoding=true with rollout.constrained_decoding=false:
    rehearsals are constrained only when both are on."""
    if rehearsal_constrained and not rollout_constrained:
        warnings.warn("rehearsal.constrained_decoding=true has no effect with rollout.constrained_decoding=false: "
                      "rehearsals are constrained only when both are true", UnusedSettingWarning, stacklevel=3)


def check_rollout(engine: str, vllm_kwargs: Mapping[str, Any]) -> None:
    """Raises ValueError for rollout.vllm_kwargs with rollout.engine=hf, which never reads them."""
    if vllm_kwargs and engine != "vllm":
        raise ValueError(f"vllm_kwargs {dict(vllm_kwargs)} are read only by rollout.engine=vllm, but the engine "
                         f"is {engine!r}: set rollout.engine=vllm, or drop rollout.vllm_kwargs")


def check_trained_roles(trained_roles: list[str], source: str, user_rehearse: bool) -> None:
    """Raises ValueError when train.trained_roles names a role no rollout produces rows for, so its
    training would be silently empty: 'user' without rollout.user_rehearse=true, or, with
    rollout.source=real (ACT only), a list without 'act'."""
    if "user" in trained_roles and not user_rehearse:
        rest = [r for r in trained_roles if r != "user"] or ["act", "rehearse"]
        raise ValueError("train.trained_roles includes 'user', but USER rows exist only with USER-REHEARSE: "
                         f"set rollout.user_rehearse=true, or train.trained_roles=[{','.join(rest)}]")
    if source == "real" and "act" not in trained_roles:
        raise ValueError(f"train.trained_roles={trained_roles} trains no rows: rollout.source=real rolls out ACT "
                         "only, so set train.trained_roles=[act] (or rollout.source=imagined)")


def scalar_kinds(annotation: Any) -> set[type]:
    """The scalar types a field annotation admits: ``Optional[int]`` → {int, NoneType}, a Literal → the
    types of its values, ``PositiveInt`` → {int}; {object} for Any, a container or a model (anything)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return scalar_kinds(args[0])
    if origin in (Union, UnionType):
        return set().union(*(scalar_kinds(a) for a in args))
    if origin is Literal:
        return {type(a) for a in args}
    if annotation is type(None) or annotation in (bool, int, float, str):
        return {annotation}
    return {object}


def item_annotation(annotation: Any, container: type, index: int) -> Any:
    """The annotation of a `container` (list or dict) field's items (index 0) or values (index 1), through
    Optional and Annotated; Any when the field is no such container."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return item_annotation(args[0], container, index)
    if origin in (Union, UnionType):
        found = [item_annotation(a, container, index) for a in args if a is not type(None)]
        return found[0] if len(found) == 1 else Any
    return args[index] if origin is container and len(args) > index else Any


class ItemError(ValueError):
    """A ValueError about one item of a list or mapping setting: `at` is its position ('[1]', '.calculate',
    nested ones joined), `reason` what is wrong with it; `config.load_config` names the setting then `at`."""

    def __init__(self, at: str, reason: str) -> None:
        super().__init__(f"{at}: {reason}")
        self.at, self.reason = at, reason


def plain_number(value: Any, annotation: Any) -> Any:
    """`value` unchanged if it suits a number field of type `annotation` (int or float, not bool or str,
    also list items and dict values).

    Raises:
        ValueError: a boolean (YAML reads true/yes/on as one), a float for an integer setting (JSON's 2.0
            or 1e3), or a string that is not a plain decimal: an int takes an optional sign and digits
            with no leading 0, a float that or a decimal fraction and exponent (0.5, 1e-5).
        ItemError: any of these in a list item or mapping value, with its position.
    """
    if isinstance(value, (list, dict)):
        inner = item_annotation(annotation, *((list, 0) if isinstance(value, list) else (dict, 1)))
        items = enumerate(value) if isinstance(value, list) else value.items()
        for k, v in items:
            at = f"[{k}]" if isinstance(value, list) else f".{k}"
            try:
                plain_number(v, inner)
            except ItemError as e:
                raise ItemError(at + e.at, e.reason) from None
            except ValueError as e:
                raise ItemError(at, str(e)) from None
        return value
    kinds = scalar_kinds(annotation)
    if not kinds & {int, float} or kinds & {bool, str, object}:
        return value
    if isinstance(value, bool):
        raise ValueError(f"expects a number, not the boolean {value} (YAML reads true/false, yes/no and "
                         "on/off as booleans)")
    if isinstance(value, float) and float not in kinds:
        whole = f": write {int(value)}" if math.isfinite(value) and value.is_integer() else ""
        raise ValueError(f"expects an integer, not the number {value!r}{whole}")
    text = value.strip() if isinstance(value, str) else None
    if text is not None and float not in kinds and not DECIMAL_INT.fullmatch(text):
        raise ValueError(f"{value!r} is not a plain decimal integer: write digits only, with no leading 0, '_', "
                         "0x/0o/0b or ':' (YAML 1.1 would read 010 as 8, 0x10 as 16, 1_000 as 1000), e.g. 10")
    if text is not None and not (DECIMAL_NUMBER.fullmatch(text) or _INF_NAN.fullmatch(text)):
        raise ValueError(f"{value!r} is not a plain decimal number: write e.g. 0.5, 2 or 1e-5 (no '_', "
                         "0x/0o/0b or ':')")
    return value


def warn_memory_warmup(train: Any, rehearsal: Any) -> None:
    """Warn (`UnusedSettingWarning`) where train.sft_act_memory's examples do not show the memory of test time:
    only faithful rehearsals under rehearsal.memory_content=pitfalls render to nothing (no example at all), and
    under "consensus" the examples' memories render as "calls" (`rehearsal.memory_examples`), not as the
    one-line consensus the committed ACT reads."""
    if not train.sft_act_memory or train.sft_warmup_steps == 0 or "act" not in train.sft_roles:
        return
    if rehearsal.memory_content == "pitfalls" and set(train.sft_act_memory_kinds) == {"faithful"}:
        warnings.warn("train.sft_act_memory_kinds=[faithful] adds no example under rehearsal.memory_content=pitfalls: "
                      "a faithful rehearsal has no failed call, so its memory is empty; add imagined_error or "
                      "wrong_call", UnusedSettingWarning, stacklevel=3)
    if rehearsal.memory_content == "consensus":
        warnings.warn("train.sft_act_memory=true with rehearsal.memory_content=consensus: the warm-up's memories "
                      "render as 'calls' (each rehearsal's calls and results), not as the one-line consensus the "
                      "committed ACT reads at test time", UnusedSettingWarning, stacklevel=3)


def check_across_sections(cfg: Any) -> Any:
    """The checks of a `RunConfig` that read more than one section (`check_trained_roles`,
    `warn_unused_constraint`, `warn_unknown_budget_tools`, `warn_memory_warmup`); returns `cfg` (a pydantic
    after-validator)."""
    from envace_core.roles.bounds import REHEARSE_TOKENS_PER_TOOL

    check_trained_roles(cfg.train.trained_roles, cfg.rollout.source, cfg.rollout.user_rehearse)
    warn_unused_constraint(cfg.rollout.constrained_decoding, cfg.rehearsal.constrained_decoding)
    warn_unknown_budget_tools(cfg.rollout.max_new_tokens_rehearse_per_tool, cfg.data.domains, REHEARSE_TOKENS_PER_TOOL)
    warn_memory_warmup(cfg.train, cfg.rehearsal)
    return cfg
