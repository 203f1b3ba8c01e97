"""`plan --model NAME`: one case-insensitive list of every preset, both planners', with a did-you-mean."""

from __future__ import annotations

import difflib


def preset_names() -> list[str]:
    """Every model preset: the transformer planner's and the data-parallel planner's, sorted."""
    from ringtree.sim.training.plan import MODELS
    from ringtree.sim.training.transformer import MODELS as TRANSFORMERS

    return sorted({*MODELS, *TRANSFORMERS})


def resolve(name: str) -> str:
    """The preset's own spelling of `name` (any case), 'transformer', or a ValueError naming the
    closest presets and the full list."""
    if name.lower() == "transformer":
        return "transformer"
    names = preset_names()
    by_lower = {n.lower(): n for n in names}
    if name.lower() in by_lower:
        return by_lower[name.lower()]
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(by_lower[c] for c in close)}? " if close else ""
    raise ValueError(
        f"unknown --model {name!r}; {hint}choose one of {', '.join(names)}, or 'transformer' with "
        "its shape (--layers, --hidden, ...)"
    )


def param_count(name: str) -> int:
    """A preset's parameters, whichever planner holds it (a transformer's from its shape)."""
    from ringtree.sim.training.plan import MODELS
    from ringtree.sim.training.transformer import MODELS as TRANSFORMERS

    return MODELS[name] if name in MODELS else int(TRANSFORMERS[name].params)
