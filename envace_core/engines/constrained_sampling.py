"""Drawing tokens under decoding constraints (`SamplingParams.constraints`), one decode step at a time.

Rejection with renormalisation: a row's drawn token that its constraint refuses is removed from that
row's distribution and the row draws again from what is left, with its own generator, up to `tries`
draws; this samples exactly the distribution restricted to the allowed tokens it meets, without
checking the whole vocabulary (llguidance and xgrammar build a token mask per step instead; a
constraint written in Python on decoded text could not afford one). When `tries` draws are refused,
the `scan` most probable remaining tokens are tried in order (greedy decoding tries them in order
from the start): a format's next character is often far down a small model's ranking (a `}` where it
wanted a word), so the scan goes deep, and stops at the first allowed token. A row whose every tried
token is refused has no token this step: the caller ends it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from envace_core.engines.base import OutputConstraint


def _allowed(check: OutputConstraint, ids: list[int], ends: bool) -> bool:
    ok = check.allows(ids, ends)
    if not isinstance(ok, bool):
        raise TypeError(f"{type(check).__name__}.allows returned {type(ok).__name__}, not a bool")
    return ok


def constrain_step(chosen: torch.Tensor, probs: torch.Tensor | None, logp: torch.Tensor,
                   checks: Sequence[OutputConstraint | None], toks: Sequence[list[int]], stop: set[int],
                   gens: Sequence[torch.Generator] | None, tries: int = 8, scan: int = 2048) -> tuple[torch.Tensor, list[int], int]:
    """The step's tokens with every row's constraint honoured.

    chosen: (S,) long, the tokens drawn for the S rows; probs: (S, V) float32 sampling probabilities
    (after top-p), or None when decoding greedily; logp: (S, V) float32 log-probs (the scan order);
    checks: S constraints or None; toks: S lists of the ids generated so far (the candidate not
    included); stop: the stop token ids (a candidate among them asks ``ends=True``); gens: S
    generators (sampling) or None (greedy).
    Raises TypeError when a constraint's ``allows`` returns anything but a bool.
    Returns (chosen with refused tokens replaced, in place, the rows with no allowed token, the number
    of rows whose drawn token was refused).
    """
    dead: list[int] = []
    refusals = 0
    for b, check in enumerate(checks):
        if check is None:
            continue
        tok = int(chosen[b])
        if _allowed(check, toks[b] + [tok], tok in stop):
            continue
        refused = {tok}
        refusals += 1
        found = None
        if probs is not None:
            w = probs[b].double().clone()
            w[tok] = 0.0
            for _ in range(tries - 1):
                total = float(w.sum())
                if total <= 0.0:
                    break
                u = torch.rand((), generator=gens[b], dtype=torch.float64, device=w.device)
                t = int(torch.searchsorted(w.cumsum(0), (u * total).reshape(1), right=True)[0].clamp(max=w.shape[0] - 1))
                if _allowed(check, toks[b] + [t], t in stop):
                    found = t
                    break
                refused.add(t)
                w[t] = 0.0
        if found is None:
            for t in torch.topk(logp[b], min(scan + len(refused), logp.shape[-1])).indices.tolist():
                if t not in refused and _allowed(check, toks[b] + [t], t in stop):
                    found = t
                    break
        if found is None:
            dead.append(b)
        else:
            chosen[b] = found
    return chosen, dead, refusals
