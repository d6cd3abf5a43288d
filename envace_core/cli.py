"""`envace` command line: run the pipeline without Flyte, and inspect the model registry.

    envace train [--profile cpu-smoke] [--overrides 'train.iterations=1']
    envace config [--check]          print the resolved config; --check also resolves the model
    envace registry list|show NAME@VERSION|verify NAME@VERSION [--profile ...]
"""

from __future__ import annotations

import argparse
import json
import sys

import envace_core  # noqa: F401  (offline environment first)
from envace_core import EnvaceError
from envace_core.config import PROFILES, load_config


def _train(args) -> int:
    from envace_core import stages

    cfg = load_config(args.profile, args.overrides)
    ds = stages.curate(cfg)
    tr = stages.rollout_and_train(cfg, ds)
    val = stages.validate(cfg, ds, tr)
    ev = stages.evaluate(cfg, ds, tr)
    stages.register(cfg, ds, tr, val, ev, execution_id="cli")
    return 0


def _config(args) -> int:
    """Print the resolved config; with --check, also resolve the model and open the stores."""
    cfg = load_config(args.profile, args.overrides)
    if args.check:
        from envace_core.stages import preflight

        preflight(cfg, resolve_remote=True)
    print(json.dumps(cfg.to_dict(), indent=2))
    return 0


def _registry(args) -> int:
    from envace_core.lineage import Registry

    reg = Registry(load_config(args.profile, args.overrides).store.registry)
    if args.action == "list":
        for name, version in reg.list():
            print(f"{name}@{version}")
        return 0
    if not args.ref or "@" not in args.ref:
        raise EnvaceError("give the model as NAME@VERSION (see `envace registry list`)")
    name, version = args.ref.split("@", 1)
    if args.action == "show":
        print(json.dumps(reg.show(name, version), indent=2))
        return 0
    bad = reg.verify(name, version)
    if bad:
        print(f"TAMPERED {name}@{version}: {len(bad)} artifact(s) differ from the manifest:")
        for b in bad:
            print(f"  {b}")
        return 1
    print(f"OK {name}@{version}: every artifact matches its sha256")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="envace")
    p.add_argument("--profile", default="cpu-smoke", choices=sorted(PROFILES))
    p.add_argument("--overrides", default="", help="'a.b=v,...', JSON/YAML text, or a file path")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("train", help="run the main job in-process (same stages as the Flyte workflow)")
    c = sub.add_parser("config", help="print the resolved configuration")
    c.add_argument("--check", action="store_true", help="also check the model ref and the stores")
    r = sub.add_parser("registry", help="list, show or verify registered models")
    r.add_argument("action", choices=["list", "show", "verify"])
    r.add_argument("ref", nargs="?", help="NAME@VERSION")
    args = p.parse_args(argv)
    try:
        return {"train": _train, "config": _config, "registry": _registry}[args.cmd](args)
    except EnvaceError as e:
        print(f"envace: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
