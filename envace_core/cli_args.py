"""argparse that refuses a value option given twice, for `envace` and the benchmark scripts.

argparse's default ``store`` action keeps the last of two values silently, so ``--bench tau2:airline --bench
bfcl:simple`` ran BFCL only and ``--task a --task b`` rehearsed b. `OnceArgumentParser` makes that an argparse
error naming the option (exit status 2, after argparse's usage lines).
"""

from __future__ import annotations

import argparse
from typing import Any

GIVEN_ATTR = "_options_given"  # the namespace attribute `_StoreOnce` keeps its record in; the parser drops it
LISTS = {"bench", "benches", "models", "conditions", "seeds", "verifier"}  # options that take a comma-separated list


class _StoreOnce(argparse._StoreAction):
    """argparse's default ``store`` action, except that an option given twice is an argparse error naming it
    (argparse keeps the last value silently: ``--bench tau2:airline --bench bfcl:simple`` ran BFCL only)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        given = namespace.__dict__.setdefault(GIVEN_ATTR, {})
        if self.dest in given and option_string is not None:
            several = (" (several overrides go in one comma-separated list)" if "overrides" in self.dest
                       else " (several go in one comma-separated list)" if self.dest in LISTS else "")
            raise argparse.ArgumentError(self, f"given twice ({given[self.dest]!r} and {values!r}): give it "
                                               f"once{several}")
        given[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class OnceArgumentParser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose value options (the ``store`` action, argparse's default) refuse to be
    given twice; subparsers made by `add_subparsers` are of this class too. The benchmarks use it as well."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = super().parse_known_args(args, namespace)
        ns.__dict__.pop(GIVEN_ATTR, None)
        return ns, extras


MAX_SEED = 2**31 - 1  # train.seed's range: seeds derived from it (seed x 1 000 003 + step) fit torch's generator


def seed_arg(text: str) -> int:
    """argparse ``type`` of a ``--seed``: an integer in [0, `MAX_SEED`], the range of ``train.seed``.
    Raises argparse.ArgumentTypeError (an argparse error naming the option) for anything else."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer seed") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{value} is outside 0..{MAX_SEED} (the range of train.seed)")
    return value
