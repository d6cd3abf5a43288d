"""Override text: the `a.b=v` pairs, JSON/YAML text and files of `--overrides` (and `--set`) read into
one nested mapping (`parse_overrides`), with each unquoted value typed for the setting it is for.

`envace_core.config` re-exports `ConfigError`, `parse_overrides` and `expand_dotted`; `load_config`
validates what `parse_overrides` returns.
"""

from __future__ import annotations

import copy
import json
import math
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from envace_core import EnvaceError
from envace_core.config_checks import (
    DECIMAL_INT,
    DECIMAL_NUMBER,
    item_annotation,
    scalar_kinds,
)
from envace_core.config_sections import RunConfig


class ConfigError(EnvaceError):
    """The configuration is invalid; the message lists each bad field and how to fix it."""



def _split_top_level(text: str) -> list[str]:
    """Split 'a=1,b.c=[x,y]' at the commas that separate pairs (empty items kept).

    A quote opens a quoted string only at the start of a value: after the pair's first '=', or after '[',
    '{', ',' or ':' inside a flow list or mapping (in it, '' is a single quote and \\" a double one);
    anywhere else ' and " are literal (``data.dvc_path=it's``). Likewise '[' and '{' open a flow collection
    only at the start of a value or inside one, so ``store.root=/tmp/x]`` is a path.

    Raises:
        ConfigError: a quote that is never closed (it would swallow the overrides after it).
    """
    parts: list[str] = []
    cur: list[str] = []
    depth, quote, opened, start, in_value, i = 0, "", 0, False, False, 0
    while i < len(text):
        ch, nxt = text[i], text[i + 1:i + 2]
        cur.append(ch)
        i += 1
        if quote:
            if (quote == "'" and ch == "'" and nxt == "'") or (quote == '"' and ch == "\\"):
                cur.append(nxt)  # an escaped quote (or character) inside the string
                i += 1
            elif ch == quote:
                quote, start = "", False
        elif ch.isspace():
            continue
        elif start and ch in "'\"":
            quote, opened = ch, i
        elif ch in "[{" and (start or depth):
            depth, start = depth + 1, True
        elif ch in "]}" and depth:
            depth, start = depth - 1, False
        elif ch == "," and not depth:
            parts.append("".join(cur[:-1]))
            cur, in_value, start = [], False, False
        elif ch == "=" and not in_value and not depth:
            in_value = start = True
        else:
            start = bool(depth) and ch in ",:"
    if quote:
        raise ConfigError(f"overrides {text!r}: the {quote} at character {opened} opens a quoted value that is "
                          f"never closed: close it (a quote opens a value only right after '=' or at the start "
                          f"of a list item; inside a word, as in it's, it is a plain character)")
    parts.append("".join(cur))
    return parts


class _Plain:
    """An unquoted YAML scalar that YAML 1.1 reads as a boolean, number or date: the text as typed and
    YAML's reading of it, until `_typed` knows the type of the setting it is for."""

    __slots__ = ("text", "value")

    def __init__(self, text: str, value: Any) -> None:
        self.text, self.value = text, value

    def __deepcopy__(self, memo: dict) -> _Plain:
        return self


class _OverrideLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that an unquoted bool, int, float or timestamp becomes a `_Plain`
    (mapping keys keep YAML's reading)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        mapping = super().construct_mapping(node, deep)
        return {(k.value if isinstance(k, _Plain) else k): v for k, v in mapping.items()}


def _keep_text(construct: Any) -> Any:
    def construct_plain(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        value = construct(loader, node)
        return _Plain(node.value, value) if node.style is None else value
    return construct_plain


for _tag in ("bool", "int", "float", "timestamp"):
    _OverrideLoader.add_constructor(f"tag:yaml.org,2002:{_tag}",
                                    _keep_text(getattr(yaml.SafeLoader, f"construct_yaml_{_tag}")))


def _load_yaml(text: str, where: str, path: tuple[str, ...] = (), lines: bool = False) -> Any:
    """`text` read as YAML by `_OverrideLoader` (unquoted booleans, numbers and dates as `_Plain`).

    Raises:
        yaml.YAMLError: `text` does not parse.
        ConfigError: a mapping anywhere in it has a key twice, which PyYAML would keep the last of
            silently; named as `where` set <dotted key under `path`> twice, with its lines if `lines`
            (`text` is a file's). YAML merge keys (<<) are no repeats.
    """
    loader = _OverrideLoader(text)
    done: set[int] = set()

    def check(node: yaml.Node, under: tuple[str, ...]) -> None:
        if id(node) in done:  # an alias of a node already checked
            return
        done.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            for n, item in enumerate(node.value):
                check(item, (*under, str(n)))
        if not isinstance(node, yaml.MappingNode):
            return
        first: dict[Any, yaml.Mark] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                check(value_node, under)
                continue
            key = loader.construct_object(key_node, deep=True)
            key = key.value if isinstance(key, _Plain) else key
            try:
                mark = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the constructor reports it
                continue
            if mark is not key_node.start_mark:
                both = " and ".join(str(m.line + 1) for m in (mark, key_node.start_mark))
                at = f" (line {mark.line + 1})" if mark.line == key_node.start_mark.line else f" (lines {both})"
                raise ConfigError(f"{where} set {'.'.join((*under, str(key)))} twice{at if lines else ''}: "
                                  "give each setting once")
            check(value_node, (*under, str(key)))

    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check(node, path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


class _JsonObject(list):
    """A JSON object's (key, value) pairs in order, before `_json_dict` checks them."""


def _json_dict(value: Any, where: str, path: tuple[str, ...] = ()) -> Any:
    """`value` with every `_JsonObject` made a dict; ConfigError naming `where` and the dotted key when an
    object has a key twice (json.load would keep the last silently)."""
    if isinstance(value, list) and not isinstance(value, _JsonObject):
        return [_json_dict(v, where, (*path, str(n))) for n, v in enumerate(value)]
    if not isinstance(value, _JsonObject):
        return value
    out: dict[str, Any] = {}
    for key, v in value:
        if key in out:
            raise ConfigError(f"{where} set {'.'.join((*path, key))} twice: give each setting once")
        out[key] = _json_dict(v, where, (*path, key))
    return out


def _model_fields(annotation: Any) -> dict[str, Any] | None:
    """{override key (alias or name): annotation} of a config section model; None for any other type."""
    if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
        return None
    fields = {name: f.annotation for name, f in annotation.model_fields.items()}
    return {**fields, **{f.alias: f.annotation for f in annotation.model_fields.values() if f.alias}}


def _typed(value: Any, annotation: Any) -> Any:
    """`value` (parsed overrides for a setting of type `annotation`) with every `_Plain` resolved for that
    type: a str setting keeps the text as typed (``store.model_name=123`` is "123", ``data.dvc=off`` is
    "off"); an int or float setting gets the number when the text is a plain decimal, else the text,
    which the model refuses by name (``010``, ``0x10``, ``1_000``); booleans stay booleans, so a number
    setting refuses them too; a setting of any type (or an unknown key) gets YAML's reading."""
    fields = _model_fields(annotation)
    if isinstance(value, dict):
        inner = item_annotation(annotation, dict, 1)
        return {k: _typed(v, fields.get(k, Any) if fields is not None else inner) for k, v in value.items()}
    if isinstance(value, list):
        return [_typed(v, item_annotation(annotation, list, 0)) for v in value]
    if not isinstance(value, _Plain):
        return value
    kinds, text, read = scalar_kinds(annotation), value.text, value.value
    if object in kinds or fields is not None:
        return read
    if isinstance(read, bool):
        return text if str in kinds and bool not in kinds else read
    if int in kinds and DECIMAL_INT.fullmatch(text):
        return int(text)
    if float in kinds and DECIMAL_NUMBER.fullmatch(text):
        return float(text)
    if float in kinds and isinstance(read, float) and not math.isfinite(read):
        return read  # .inf / .nan: the model refuses it as not a finite number
    return text if kinds & {int, float, str} else read


PAIRS_FORM = "key=value,key=value (e.g. train.iterations=2,rollout.group_size=4)"
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_NEXT_PAIR = re.compile(r"[\s;]+[A-Za-z_][\w.]*\s*=")  # "1 rollout.group_size=2": a second pair after a space


def _put(node: dict[str, Any], parts: list[str], value: Any, where: str, above: tuple[str, ...] = ()) -> None:
    """Set the dotted key `parts` (under `above`) in the nested mapping `node`, merging mappings; ConfigError
    when `where` gives a setting, or a setting and a part of it, twice."""
    key = ".".join((*above, *parts))
    for i, p in enumerate(parts[:-1]):
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{where} set {'.'.join((*above, *parts[:i + 1]))} and also {key}: give each "
                              "setting once")
    leaf = parts[-1]
    if leaf not in node:
        node[leaf] = value
    elif isinstance(node[leaf], dict) and isinstance(value, dict):
        for k, v in value.items():
            _put(node[leaf], [k], v, where, (*above, *parts))
    else:
        raise ConfigError(f"{where} set {key} twice: give each setting once")


def expand_dotted(data: dict[str, Any], where: str = "the overrides") -> dict[str, Any]:
    """`data` with each top-level dotted key (``train.iterations: 2``) turned into nested mappings, as an
    a.b=v override means it. Raises ConfigError naming `where` when a setting is given twice."""
    if not any(isinstance(k, str) and "." in k for k in data):
        return data
    out: dict[str, Any] = {}
    for k, v in copy.deepcopy(data).items():
        _put(out, k.split(".") if isinstance(k, str) and _KEY.fullmatch(k) else [k], v, where)
    return out


def _parse_pairs(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in _split_top_level(text):
        if not pair.strip():
            raise ConfigError(f"overrides {text!r} have an empty item (two commas in a row, or a comma at the "
                              f"start or end): write {PAIRS_FORM}")
        key, sep, raw = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {pair.strip()!r} is not of the form a.b=value: write {PAIRS_FORM}")
        if not _KEY.fullmatch(key):
            raise ConfigError(f"override {pair.strip()!r}: {key!r} is not a setting name (a.b, e.g. "
                              f"train.iterations); overrides are separated by commas, not spaces: write {PAIRS_FORM}")
        if not raw.strip():
            raise ConfigError(f"override {pair.strip()!r} has no value: write {key}=VALUE (null for none)")
        if not raw.lstrip().startswith(("'", '"', "[", "{")) and _NEXT_PAIR.search(raw):
            raise ConfigError(f"override {pair.strip()!r} holds another override after a space or ';': "
                              f"separate overrides with commas: write {PAIRS_FORM}")
        annotation, extra = _annotation_at(key.split(".")), _dropped_by_yaml(raw)
        if annotation is not None and extra and _is_text(annotation):
            _put(out, key.split("."), raw.strip(), f"the overrides {text!r}")  # the text as typed, '#' and all
            continue
        if annotation is not None and extra:
            raise ConfigError(f"override {pair.strip()!r}: the value holds {extra}, which YAML would drop or "
                              "read as markup, not as the value: remove it (in a list item, quote the text)")
        try:
            value = _load_yaml(raw, f"the overrides {text!r}", tuple(key.split(".")))
        except yaml.YAMLError as e:
            raise ConfigError(f"the value of override {key!r} is not valid YAML: {raw!r}") from e
        _put(out, key.split("."), value, f"the overrides {text!r}")
    return out


def _annotation_at(parts: list[str]) -> Any:
    """The annotation of the setting at the dotted key `parts` of `RunConfig` (a key inside a mapping
    setting gets the mapping's value type); None for an unknown key."""
    annotation: Any = RunConfig
    for part in parts:
        fields = _model_fields(annotation)
        if fields is not None and part not in fields:
            return None
        annotation = fields[part] if fields is not None else item_annotation(annotation, dict, 1)
    return annotation


def _is_text(annotation: Any) -> bool:
    """Whether a setting of type `annotation` is text (str, a Literal of strings, or either or None)."""
    kinds = scalar_kinds(annotation)
    return str in kinds and kinds <= {str, type(None)}


def _dropped_by_yaml(raw: str) -> str | None:
    """What in the unquoted value `raw` YAML would not read as part of it: a comment (' #...', or a value
    that starts with '#'), an anchor (&a), an alias (*a) or a tag (!!int); None when there is none or
    `raw` does not parse (the YAML load reports that)."""
    try:
        tokens = list(yaml.scan(raw))
    except yaml.YAMLError:
        return None
    for kind, what in ((yaml.AnchorToken, "an anchor (&name)"), (yaml.AliasToken, "an alias (*name)"),
                       (yaml.TagToken, "a tag (!...)")):
        if any(isinstance(t, kind) for t in tokens):
            return what
    end = max((t.end_mark.index for t in tokens
               if not isinstance(t, (yaml.StreamStartToken, yaml.StreamEndToken))), default=0)
    return "a comment ('#' and what follows)" if end < len(raw.rstrip()) else None


def _yaml_problem(e: yaml.YAMLError) -> str:
    """'<problem> (line L, column C)' of a YAML parse error."""
    mark = getattr(e, "problem_mark", None)
    problem = " ".join(x for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else problem


def _is_pairs(text: str) -> bool:
    """Whether one-line override text is ``a.b=v`` pairs rather than YAML/JSON: it holds '=', does not open a
    flow mapping or list, and what comes before its first '=' is a setting name, or at least holds no
    YAML ``key: value`` form (``store.root: /x/a=b`` is YAML; ``a b=1`` is pairs, refused by name)."""
    if "=" not in text or "\n" in text or text.startswith(("{", "[")):
        return False
    before = text.partition("=")[0].strip()
    return bool(_KEY.fullmatch(before)) or not re.search(r":(\s|$)", before)


def _looks_like_path(text: str) -> bool:
    """Whether override text that is no file is most likely a mistyped file path rather than overrides."""
    return not re.search(r"[=:]", text) and ("/" in text or text.endswith((".yaml", ".yml", ".json", ".txt")))


def _read_file(source: str) -> Any:
    """The YAML (or, for a .json name, JSON) content of the overrides file `source`.

    Raises:
        ConfigError: the file is not UTF-8, does not parse (with the line and column), is empty, holds
            ``a.b=v`` pairs (a file holds YAML or JSON), or repeats a key in one mapping.
    """
    where = f"config overrides file {source!r}"
    try:
        text = Path(source).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if source.endswith(".json"):
        try:
            return _json_dict(json.loads(text, object_pairs_hook=_JsonObject), where)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    try:
        data = _load_yaml(text, where, lines=True)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML/JSON: {_yaml_problem(e)}") from None
    if data is None:
        raise ConfigError(f"{where} is empty: write settings as YAML (train.iterations: 4) or JSON")
    pair = re.match(r"\s*([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)\s*=[ \t]*(.*)", text)
    if isinstance(data, (str, _Plain)) and pair:
        raise ConfigError(f"{where} holds a.b=value pairs, but a file holds YAML or JSON: write "
                          f"{pair[1]}: {pair[2].strip() or 'VALUE'}, one setting a line")
    return data


def parse_overrides(overrides: str | dict[str, Any] | None) -> dict[str, Any]:
    """Overrides: a dict, a JSON/YAML string, a path to a YAML/JSON file, or 'a.b=v' pairs separated by
    commas. One-line text is pairs when what precedes its first '=' is a setting name (`_is_pairs`); a
    file is always YAML (JSON for a .json name). A mapping's top-level dotted keys (``train.iterations: 2``)
    mean what they mean as pairs. An unquoted YAML value keeps its text for a str setting
    (``store.model_name=123`` is "123"; in pairs also with '#', '&' or '!!' in it, which YAML would drop)
    and is a number for an int / float setting only as a plain decimal (`_typed`).

    Raises:
        ConfigError: a folder, a missing file (text that looks like
            a path), a non-UTF-8, empty or unparseable file (named, with the YAML / JSON error's line and
            column) or one holding pairs, pairs that are not ``key=value,key=value`` (an empty item or
            value, a second pair after a space, an unclosed quote, a comment, anchor or tag in a value of
            a non-text setting), a setting given twice (also a key twice in one mapping of a file, named
            with its lines), or anything that is not a mapping.
    """
    if overrides is None or overrides == "":
        return {}
    if isinstance(overrides, dict):
        return expand_dotted(overrides)
    text, source = overrides.strip(), None
    if not text:  # `make train` passes --overrides '$(OVERRIDES)', empty unless the user sets it
        return {}
    if not text.startswith("{") and "\n" not in text:
        try:
            kind = "folder" if Path(text).is_dir() else "file" if Path(text).is_file() else None
        except OSError:  # a name too long for a path
            kind = None
        if kind == "folder":
            raise ConfigError(f"config overrides file {text!r} is a folder: give a YAML or JSON file")
        source = text if kind == "file" else None
        if source is None and _looks_like_path(text):
            raise ConfigError(f"config overrides file {text!r} does not exist")
    where = f"config overrides file {source!r}" if source else "config overrides"
    if source:
        data = _read_file(source)
    elif _is_pairs(text):
        return _typed(_parse_pairs(text), RunConfig)
    else:
        try:
            data = _load_yaml(text, where)
        except yaml.YAMLError as e:
            raise ConfigError(f"{where} are neither a file, JSON/YAML, nor a.b=v pairs: {_yaml_problem(e)}") from None
    if isinstance(data, _Plain):
        data = data.value
    if isinstance(data, str) and not source and re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", text):
        raise ConfigError(f"override {text!r} has no value: write {text}=VALUE")
    spaced = re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)\s+(\S.*)", text) \
        if isinstance(data, str) and not source else None
    if spaced:
        raise ConfigError(f"override {text!r} has no '=': write {spaced[1]}={spaced[2]}; several are {PAIRS_FORM}")
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping or {PAIRS_FORM}, got {type(data).__name__}: {text[:80]!r}")
    return _typed(expand_dotted(data, where), RunConfig)
