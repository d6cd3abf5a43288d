"""Preflight: checks the configuration, the model reference, the store and the registry before any work starts."""

from __future__ import annotations

from pathlib import Path

from envace_core import EnvaceError
from envace_core.config import PLACEHOLDER, ConfigError, RunConfig
from envace_core.models import ROLES, AdapterError, check_adapter_dir, read_adapter_config
from envace_core.store.uri import committed_dir, init_adapter_dir, open_store


PROBE = {"connect_timeout": 3, "read_timeout": 5, "max_attempts": 2}  # seconds, seconds, tries per S3 probe


# ----------------------------------------------------------------------------------- references
def resolve_references(cfg: RunConfig, remote: bool = False) -> RunConfig:
    """`cfg` with a `train.init_adapter` written ``registry:NAME@VERSION`` replaced by where that version's
    adapter lives in `store.registry` (``<registry>/NAME/VERSION/artifacts/adapter``: a local folder, or
    the s3:// URI the train stage downloads, checked file by file against the version's commit object).
    The resolved config, which every stage reads and the lineage records, then names the version by path
    and its content by checksum (the warm start's and the run's ids). Any other value is returned as is;
    so is a registry reference when `remote` and store.registry is not s3:// (`check_remote_settings`
    then names store.registry: a cluster's pods cannot read this machine's folder).

    The version must pass `Registry.verify` (every artifact's sha256 against the manifest; the manifest's
    HMAC when $ENVACE_REGISTRY_HMAC_KEY is set) and its manifest's ``base_model.ref`` must equal
    `model.ref`: the adapter's weights are deltas over that base, so another base would load a model no
    one trained.

    Raises:
        ConfigError: a malformed reference, a version that is not registered, has no manifest, fails
            verification, has no artifacts/adapter, records no base model or another one, or an S3 registry
            that refuses (each message names the setting and the fix); store.s3.TransientStoreError when a
            retry may pass.
    """
    from envace_core import TransientError
    from envace_core.store.base import StoreError
    from envace_core.store.registry import Registry, RegistryError, base_model_ref

    ref = cfg.train.init_adapter
    if not ref or not ref.startswith("registry:"):
        return cfg
    if remote and not str(cfg.store.registry).startswith("s3://"):
        return cfg
    named = f"train.init_adapter={ref!r}"
    name, _, version = ref[len("registry:"):].partition("@")  # its NAME@VERSION form: checked when the config loaded
    reg = Registry(cfg.store.registry)
    other = "choose another version (`envace registry list --overrides store.registry=...`)"
    try:
        bad = reg.verify(name, version)
        manifest = reg.show(name, version)
    except TransientError:
        raise
    except RegistryError as e:  # not registered, no or a corrupt manifest
        raise ConfigError(f"{named}: {e} (store.registry={cfg.store.registry!r}); {other}") from None
    except StoreError as e:  # S3 refused: credentials, permissions, no such bucket
        raise ConfigError(f"{named}: {e} (store.registry={cfg.store.registry!r}); the registry could not be "
                          "read: fix the access to it, or give the adapter as a path") from None
    if bad:
        raise ConfigError(f"{named} fails verification, refusing to train from it; artifacts that differ from "
                          f"its manifest: {', '.join(bad)}; {other}, or check it with `envace registry verify`")
    if not any(k.startswith("artifacts/adapter/") for k in manifest.get("artifacts") or {}):
        raise ConfigError(f"{named}: the version holds no artifacts/adapter (a LoRA adapter) to start from; {other}")
    base = base_model_ref(manifest)
    if base is None:
        raise ConfigError(f"{named}: its manifest records no base_model.ref, so the base model its LoRA deltas "
                          f"fit is unknown; {other}, or give its artifacts/adapter folder as a path")
    if base != cfg.model.ref:
        raise ConfigError(f"{named} was trained over the base model {base!r}, but model.ref={cfg.model.ref!r}: "
                          f"its LoRA deltas fit only that base; set model.ref={base}")
    out = cfg.model_copy(deep=True)
    out.train.init_adapter = f"{reg.uri(name, version)}/artifacts/adapter"
    return out


def resolve_and_check(cfg: RunConfig, remote: bool = False, resolve_remote: bool = False) -> RunConfig:
    """`resolve_references` and `preflight` in the order that reports every problem at once; returns the
    resolved config. Locally the reference is resolved first (preflight then checks the adapter folder it
    names); on a cluster (`remote`) preflight runs first, its report listing every local path and placeholder,
    and the registry version is looked up after, so an unreachable registry does not hide the other problems.

    Raises:
        ConfigError (and the other errors of `preflight` and `resolve_references`).
    """
    if not remote:
        cfg = resolve_references(cfg)
        preflight(cfg, resolve_remote=resolve_remote)
        return cfg
    preflight(cfg, remote=True, resolve_remote=resolve_remote)
    return resolve_references(cfg, remote=True)


# -------------------------------------------------------------------------------------- preflight
def preflight(cfg: RunConfig, remote: bool = False, resolve_remote: bool = False) -> None:
    """Check before any work that the model, the artifact store and the registry are usable.

    Cheap checks only (no weights are loaded; an s3:// model is fetched only if `resolve_remote`,
    else listed), so a bad path fails in seconds instead of after training. Raises the EnvaceError
    that names the setting to fix: `check_model` for `model.ref` and `reward.judge_model` (a local
    folder with config.json, the bundled GGUF, an s3:// prefix that lists with the AWS credentials
    here), a StoreError for a `store.root` or `store.registry` that cannot be used (a local folder that
    cannot be made or written, `registry.RegistryError` for the registry's; an s3:// one: no
    credentials, endpoint unreachable, no such bucket; `registry.Registry.check`), a ConfigError for
    an s3:// `data.dvc_remote` curate could not push to (the same one-request probe; not with
    data.dvc=off), `check_init_adapter` for `train.init_adapter` (local or s3://, as the train stage will
    read it), `models.LoraTargetError` for a `train.lora_target_modules` name the base
    model lacks (checked when its config.json is on this machine), and for a local run
    model.device=cuda on a machine without CUDA (`training.policy.policy_device`).

    `remote=True` is for a cluster execution, where every stage runs in its own pod with its own
    disk: first `check_remote_settings` (one ConfigError naming every setting that would use a
    pod's disk, is a placeholder, or names S3 that cannot be used), and the vLLM and CUDA checks are
    skipped (the rollout runs in the training image, on the GPU nodes, not in this pod).
    """
    from envace_core.models import check_lora_targets, meta_model
    from envace_core.store.registry import Registry

    if remote:
        check_remote_settings(cfg)
    else:
        check_placeholders(cfg)
    if not remote and cfg.model.device == "cuda":
        from envace_core.training.policy import policy_device

        try:
            policy_device("cuda")
        except EnvaceError as e:  # a cluster's GPU pods are not this machine: `config --remote` skips this
            raise ConfigError(f"{e} (for a cluster run, check with `envace config --remote`)") from None
    if cfg.data.dvc != "off" and cfg.data.dvc_repo and not (Path(cfg.data.dvc_repo) / ".dvc").is_dir():
        raise ConfigError(f"data.dvc_repo={cfg.data.dvc_repo!r} holds no .dvc/ folder: point it at a DVC "
                          "repository (`dvc init`), or unset it to use the checkout's own")
    model_dir = check_model(cfg.model.ref, "model.ref", resolve_remote, list_s3=not remote)
    if cfg.reward.judge_model and not remote:
        check_model(cfg.reward.judge_model, "reward.judge_model", resolve_remote)
    _named(lambda: open_store(cfg.store.root).check(), "store.root", cfg.store.root)
    _named(lambda: Registry(cfg.store.registry).check(), "store.registry", cfg.store.registry)
    dvc_remote = cfg.data.dvc_remote or ""
    if cfg.data.dvc != "off" and dvc_remote.startswith("s3://") and not remote:  # the remote check probed it
        from envace_core.store.s3 import S3Store

        _s3_check(lambda: S3Store(dvc_remote.rstrip("/"), setting="data.dvc_remote", **PROBE).check(),
                  "data.dvc_remote", dvc_remote)
    adapter = cfg.train.init_adapter
    # the remote check read an s3:// one already, and named a registry:NAME@VERSION's local store.registry
    if adapter and not (remote and adapter.startswith(("s3://", "registry:"))):
        check_init_adapter(cfg)
    model = meta_model(model_dir) if model_dir is not None else None
    if model is not None:
        check_lora_targets(list(cfg.train.lora_target_modules), model)
    if cfg.rollout.engine == "vllm" and not remote:
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            from envace_core.engines.vllm import EngineUnavailableError

            raise EngineUnavailableError("rollout.engine=vllm needs vLLM, which is not installed here: use the "
                                         "train-cuda image or pip install 'envace[gpu]' on a CUDA machine, or "
                                         "set rollout.engine=hf (the transformers engine, CPU)")


def check_model(ref: str, setting: str, resolve_remote: bool = False, list_s3: bool = True) -> Path | None:
    """Check the base model reference `ref` of `setting` (model.ref, reward.judge_model) without loading
    weights: the bundled GGUF is installed; a local path is a folder with config.json; an s3:// prefix is
    downloaded when `resolve_remote`, else listed when `list_s3` (credentials, bucket, a config.json there);
    a ``registry:`` ref is refused (it names a trained adapter). Returns the model's local folder when there
    is one without downloading or dequantising anything, else None.

    Raises:
        models.ModelNotFoundError, or ConfigError naming `setting` for an S3 failure (no credentials,
        unreachable, no such bucket); store.base.TransientError when S3 failed in a way a retry may fix.
    """
    from envace_core.models import BUNDLED, bundled_gguf_path, bundled_model_dir, resolve_model, s3_model_listing

    if ref == BUNDLED:
        bundled_gguf_path()
        d = bundled_model_dir()
        return d if d.is_dir() else None
    if ref.startswith("s3://") and not resolve_remote:
        if list_s3:
            _s3_check(lambda: s3_model_listing(ref, setting), setting, ref)
        return None
    return _s3_check(lambda: resolve_model(ref, setting), setting, ref)


def _named(call, setting: str, value: str):
    """`call()`, with a StoreError re-raised as the same class with `setting=value: ` in front, so that a
    store that cannot be created or reached names what to fix (a transient one stays transient)."""
    from envace_core.store.base import StoreError

    try:
        return call()
    except StoreError as e:
        if str(e).startswith(setting):
            raise
        try:
            named = type(e)(f"{setting}={value!r}: {e}")
        except TypeError:  # a subclass with another constructor: keep it as it is
            raise e from None
        raise named from None


def _s3_check(call, setting: str, value: str):
    """`call()`, with an S3 failure's StoreError (not a transient one) raised as a ConfigError naming the setting."""
    from envace_core import TransientError
    from envace_core.store.base import StoreError

    try:
        return call()
    except StoreError as e:
        if isinstance(e, TransientError) or str(e).startswith(setting):
            raise
        raise ConfigError(f"{setting}={value!r}: {e}") from None


def check_placeholders(cfg: RunConfig) -> None:
    """Refuse the profiles' ``CHANGE-ME`` placeholders before anything tries to reach them (a local
    check would otherwise ask S3 for a bucket named CHANGE-ME). Raises one ConfigError naming each."""
    values = [("store.root", cfg.store.root), ("store.registry", cfg.store.registry), ("model.ref", cfg.model.ref),
              ("data.dvc_remote", cfg.data.dvc_remote), ("train.init_adapter", cfg.train.init_adapter),
              ("reward.judge_model", cfg.reward.judge_model)]
    bad = [f"{name}={value!r} is a placeholder: set {name}=s3://BUCKET/PREFIX (or a local path for a local run)"
           for name, value in values if value and PLACEHOLDER in value.upper()]
    if bad:
        raise ConfigError(f"{len(bad)} setting(s) still hold the profile's placeholder:\n  - " + "\n  - ".join(bad))


def check_remote_settings(cfg: RunConfig, probe: bool = True) -> None:
    """For a cluster execution: every place a later stage reads from or writes to must be shared storage.

    Checks `store.root`, `store.registry`, `model.ref` and, unless `data.dvc=off`, the DVC remote curate
    would push to (`data.dvc_remote`, else the repo's default remote; `store.dvc.push_target`). Each
    must be an ``s3://`` URI (`model.ref` may also be ``bundled:...``, the GGUF inside the image) without
    the placeholder ``CHANGE-ME``, and each s3:// bucket is probed once (`store.s3.S3Store.check`: one
    HeadBucket with `PROBE`'s 3 s connect / 5 s read timeouts and 2 tries: credentials present, endpoint
    reachable, bucket exists); `model.ref` (and `reward.judge_model` for the judge reward) must also list a
    ``config.json`` (one LIST request each), and `train.init_adapter` must pass `check_init_adapter` (its
    committed store directory's CHECKSUMS.json and adapter_config.json, no weights; a ``registry:`` adapter
    is resolved from the registry checked here). After the
    first unreachable endpoint no further bucket is probed, so a dead endpoint costs one probe's time.
    `data.dvc=require` without a DVC repository here is refused too.

    `probe=False` checks the settings' form only (no request; e.g. at registration).

    Raises:
        ConfigError: one message listing every bad setting, each with what to set instead.
    """
    from envace_core.models import s3_model_listing
    from envace_core.store.dvc import DVCError, push_target
    from envace_core.store.s3 import S3Store

    why_shared = ("on a cluster each stage runs in its own pod, whose disk is gone when the stage ends, so "
                  "later stages would not find what this one wrote")
    why_input = "on a cluster each stage runs in its own pod, which sees only its image and S3, not this machine's disk"
    inputs = ("model.ref", "reward.judge_model", "train.init_adapter")  # read by the stages, never written
    settings: list[tuple[str, str, str]] = [  # (setting, value, what to set)
        ("store.root", cfg.store.root, "store.root=s3://BUCKET/PREFIX"),
        ("store.registry", cfg.store.registry, "store.registry=s3://BUCKET/PREFIX"),
        ("model.ref", cfg.model.ref, "model.ref=s3://BUCKET/PREFIX (a HF model folder) or "
                                     "bundled:smollm2-135m-instruct"),
    ]
    optional = [("train.init_adapter", cfg.train.init_adapter, "train.init_adapter=s3://BUCKET/PREFIX (a LoRA "
                 "adapter folder)")]
    if cfg.reward.name == "judge" and cfg.reward.judge_model:
        optional.append(("reward.judge_model", cfg.reward.judge_model, "reward.judge_model=s3://BUCKET/PREFIX "
                         "(a HF model folder), or unset (the policy's base model judges)"))
    settings += [(name, value, fix) for name, value, fix in optional if value]
    problems: list[str] = []
    try:
        url, where = push_target(cfg.data)
    except DVCError as e:
        problems.append(f"data.dvc={cfg.data.dvc}: {e}; fix .dvc/config or set data.dvc=off")
        url, where = None, ""
    if url is not None:
        setting = "data.dvc_remote" if cfg.data.dvc_remote else f"data.dvc_remote (unset: {where})"
        settings.append((setting, url, "data.dvc_remote=s3://BUCKET/PREFIX, or data.dvc=off"))
    elif cfg.data.dvc != "off" and cfg.data.dvc_remote:
        problems.append(f"data.dvc_remote={cfg.data.dvc_remote!r} is set but {where}, so curate would not "
                        "version the data: the image must carry .dvc/ and data.dvc (or set data.dvc_repo), "
                        "or set data.dvc=off")
    elif cfg.data.dvc == "require":
        problems.append(f"data.dvc=require but {where}: the image must carry .dvc/ (or set data.dvc_repo), "
                        "or set data.dvc=auto/off")

    usable: set[str] = set()  # buckets whose probe passed
    unreachable = False
    for setting, value, fix in settings:
        name = setting.split(" ")[0]
        if PLACEHOLDER in value.upper():
            problems.append(f"{setting}={value!r} is a placeholder: set {fix}")
            continue
        if name in ("model.ref", "reward.judge_model") and value.startswith("bundled:"):
            continue
        if value.startswith("registry:"):  # train.init_adapter (the model settings refuse it when they load):
            continue  # resolved from the (S3) registry by resolve_references
        if not value.startswith("s3://"):
            problems.append(f"{setting}={value!r} is a local path: {why_input if name in inputs else why_shared}; "
                            f"set {fix}")
            continue
        if not probe:  # registration time: the form only, S3 is the pods' to reach
            continue
        if unreachable:
            problems.append(f"{setting}={value!r}: not checked, S3 is unusable (above)")
            continue
        bucket = value[len("s3://"):].split("/", 1)[0]
        try:
            if bucket not in usable:
                S3Store(value.rstrip("/"), setting=name, **PROBE).check()
                usable.add(bucket)
            if name == "train.init_adapter":
                check_init_adapter(cfg)
            elif name in ("model.ref", "reward.judge_model"):
                s3_model_listing(value, name, "config.json")
        except EnvaceError as e:
            # after a dead endpoint or missing credentials every other probe would fail the same way
            unreachable = "cannot reach S3" in str(e) or "no AWS credentials" in str(e)
            problems.append(str(e) if str(e).startswith(name) else f"{setting}={value!r}: {e}")
    if problems:
        head = (f"checked as a remote (cluster) execution, {len(problems)} setting(s) cannot work there; "
                "fix them in the profile or the overrides and run again")
        raise ConfigError(head + ":\n  - " + "\n  - ".join(problems))


def check_init_adapter(cfg: RunConfig) -> None:
    """Check `train.init_adapter` the way the train stage will load it (`store.uri.init_adapter_dir`, then
    `training.loop.load_init_adapter`), reading no weights: a local folder with `models.check_adapter_dir`
    (config fields, weights present, not truncated, LoRA ranks that match the config: safetensors headers
    only); an s3:// URI by the listing of the store directory committed at or above it (`_s3_adapter`).
    Then, for both, the layout and LoRA settings against `train.*`: per-role act/ and rehearse/ folders
    exactly when `train.policy_per_role`, an adapter_model.safetensors in each (the file the train stage
    loads), and each folder's (r, lora_alpha, target_modules) equal to (train.lora_r, train.lora_alpha,
    train.lora_target_modules).

    Raises `EnvaceError` (no folder / no adapter at the path or URI, nothing committed there) or
    `models.AdapterError` naming the file and the setting; for an s3:// URI a ConfigError naming the
    setting when S3 refuses (no credentials, no such bucket), a TransientStoreError naming it when S3 is
    unreachable.
    """
    ref = cfg.train.init_adapter
    folders = _s3_adapter(ref) if ref.startswith("s3://") else _local_adapter(ref)
    per_role = len(folders) == 2
    if per_role != cfg.train.policy_per_role:
        have = "per-role act/ and rehearse/ adapters" if per_role else "one shared adapter"
        raise AdapterError(f"train.init_adapter={ref!r} holds {have}, but train.policy_per_role="
                           f"{str(cfg.train.policy_per_role).lower()}; set train.policy_per_role="
                           f"{str(per_role).lower()} or give an adapter of that layout")
    t = cfg.train
    ours = (t.lora_r, t.lora_alpha, sorted(t.lora_target_modules))
    for name, conf, safetensors in folders:
        if not safetensors:
            raise AdapterError(f"train.init_adapter={ref!r}: no adapter_model.safetensors beside {name}, and that "
                               "is the weights file the train stage loads; save the adapter with safetensors")
        tm = conf.get("target_modules")
        theirs = (conf.get("r"), conf.get("lora_alpha"), sorted(tm) if isinstance(tm, list) else tm)
        if theirs != ours:
            raise AdapterError(f"train.init_adapter={ref!r}: {name} has (r, lora_alpha, "
                               f"target_modules) = {theirs}, but train.* has (lora_r, lora_alpha, "
                               f"lora_target_modules) = {ours}; use the adapter's LoRA settings")


NO_ADAPTER = "holds no LoRA adapter (adapter_config.json, or act/ and rehearse/ for a per-role policy)"


def _local_adapter(ref: str) -> list[tuple[str, dict, bool]]:
    """(adapter_config.json's path, its content, whether adapter_model.safetensors is beside it) for each
    adapter folder of the local `train.init_adapter` `ref` (`models.check_adapter_dir`)."""
    d = init_adapter_dir(ref)
    if not any((d / sub / "adapter_config.json").is_file() for sub in (".", *ROLES)):
        raise EnvaceError(f"train.init_adapter={ref!r} {NO_ADAPTER}")
    try:
        dirs = check_adapter_dir(d)
    except AdapterError as e:
        raise AdapterError(f"train.init_adapter={ref!r}: {e}") from None
    return [(str(one / "adapter_config.json"), read_adapter_config(one / "adapter_config.json"),
             (one / "adapter_model.safetensors").is_file()) for one in dirs]


def _s3_adapter(ref: str) -> list[tuple[str, dict, bool]]:
    """`_local_adapter` for an s3:// `ref`, from what `init_adapter_dir` would download: the files below
    `ref` in the CHECKSUMS.json of the store directory committed at or above it (`store.uri.committed_dir`,
    with `PROBE`'s timeouts), reading only the adapter_config.json files (sha256-verified). An S3 failure
    names the setting: a ConfigError, or the TransientStoreError itself when a retry may pass."""
    setting = "train.init_adapter"

    def s3(call):
        return _named(lambda: _s3_check(call, setting, ref), setting, ref)

    store, key, rel, files = s3(lambda: committed_dir(ref, setting, **PROBE))
    roles = [r for r in ROLES if f"{r}/adapter_config.json" in files]
    if len(roles) == 1:
        miss = next(r for r in ROLES if r not in roles)
        raise AdapterError(f"train.init_adapter={ref!r} has {roles[0]}/ but no {miss}/adapter_config.json; a "
                           "per-role policy needs both act/ and rehearse/")
    if not roles and "adapter_config.json" not in files:
        below = _adapter_below(files)  # e.g. a registry version's artifacts/adapter
        hint = f"; one is below it: train.init_adapter={ref.rstrip('/')}/{below}" if below else ""
        raise EnvaceError(f"train.init_adapter={ref!r} {NO_ADAPTER}{hint}")
    out = []
    for sub in [f"{r}/" for r in roles] or [""]:
        name = f"{ref.rstrip('/')}/{sub}adapter_config.json"
        file_key = "/".join(p for p in (key, rel, f"{sub}adapter_config.json") if p)
        data = s3(lambda k=file_key: store.read_bytes(k))
        try:
            conf = read_adapter_config(name, data)
        except AdapterError as e:
            raise AdapterError(f"train.init_adapter={ref!r}: {e}") from None
        out.append((name, conf, f"{sub}adapter_model.safetensors" in files))
    return out


def _adapter_below(files: dict[str, str]) -> str | None:
    """The shortest folder among `files` (paths) holding an adapter_config.json, a per-role one's parent
    for its act/ or rehearse/; None when there is none."""
    folders = {p.rsplit("/", 1)[0] for p in files if p.endswith("/adapter_config.json")}
    parents = {f.rsplit("/", 1)[0] if "/" in f and f.rsplit("/", 1)[1] in ROLES else f for f in folders}
    return min(parents, key=len) if parents else None
