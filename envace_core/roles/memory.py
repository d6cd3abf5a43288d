"""The rehearsal memory text (METHOD.md §4): plans tried, constraints and pitfalls under a token budget."""

from __future__ import annotations


# ------------------------------------------------------------------------------------------ memory
def memory_text(rehearsals: list[str], max_tokens: int, tokenizer) -> str:
    """Rehearsal memory m_x (METHOD.md §4): rehearsal summaries joined under `max_tokens` tokens.

    Rule: summaries are taken newest first (the last in `rehearsals` first: a later sequential
    rehearsal has seen the earlier ones), each under a header `[rehearsal k]` (k = its 1-based position
    in `rehearsals`). Lines are added in order while the running text fits the budget; the first line
    that does not fit ends the memory (truncation at whole lines, never mid-line). Blank lines and lines
    already included from a newer summary are skipped; a header whose summary contributes no line is
    dropped. The budget counts `tokenizer.encode(text, add_special_tokens=False)` of the whole result.
    """
    if max_tokens <= 0:
        return ""

    def n_tokens(s: str) -> int:
        return len(tokenizer.encode(s, add_special_tokens=False))

    kept: list[str] = []
    seen: set[str] = set()
    full = False
    for k in range(len(rehearsals) - 1, -1, -1):
        lines = [ln.rstrip() for ln in (rehearsals[k] or "").splitlines()]
        lines = [ln for ln in lines if ln.strip() and ln.strip() not in seen]
        if not lines:
            continue
        header = f"[rehearsal {k + 1}]"
        block: list[str] = []
        for ln in lines:
            candidate = kept + [header] + block + [ln]
            if n_tokens("\n".join(candidate)) > max_tokens:
                full = True
                break
            block.append(ln)
            seen.add(ln.strip())
        if block:
            kept += [header] + block
        if full:
            break
    return "\n".join(kept)
