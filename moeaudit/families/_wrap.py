"""A family that is another family's decoder under a new label or inside a wrapper (a
vision-language or omni checkpoint): the text family's layout with its ``model.`` keys moved
under the wrapper's prefixes, and its config rules read from the wrapper's text config.

Not a family file itself (the leading underscore keeps it out of discovery)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from moeaudit.families.base import Family
from moeaudit.spec.layouts import Layout, Templates


def rebase(
    table: Mapping[str, Templates],
    bases: tuple[str, ...],
    layers: tuple[str, ...] = (),
    roots: tuple[str, ...] = ("model.",),
) -> dict[str, Templates]:
    """Each ``model.…`` template once per base (``model.language_model.``, ``language_model.model.``);
    ``layers``: further spellings of ``<base>layers.`` (transformers 5.24 saves Kimi-K2.5's decoder
    layers as ``language_model.model.blocks.*``, its load renaming read backwards); ``roots``: the
    text layout's roots moved under the bases (Nemotron-H's ``backbone.`` as well as ``model.``)."""
    out: dict[str, Templates] = {}
    for name, templates in table.items():
        alts: list[str] = []
        for t in templates:
            root = next((r for r in roots if t.startswith(r)), None)
            if root is None:
                alts.append(t)
                continue
            rest = t[len(root) :]
            for base in bases:
                alts.append(base + rest)
            if rest.startswith("layers."):
                alts += [spelling + rest[len("layers.") :] for spelling in layers]
        out[name] = tuple(dict.fromkeys(alts))
    return out


def wrapped(
    text: Family,
    name: str,
    *,
    bases: tuple[str, ...],
    heads: tuple[str, ...],
    audits: str,
    left_out: Mapping[str, str],
    layers: tuple[str, ...] = (),
    roots: tuple[str, ...] = ("model.",),
    **changes: object,
) -> Family:
    """``text``'s family read from a wrapper checkpoint: keys under ``bases``, the LM head at
    ``heads``, ``left_out`` prefixes noted (vision, audio towers); ``audits`` is the receipts'
    note of what is replayed."""
    lay = text.layout
    globals_ = rebase({k: v for k, v in lay.globals.items() if k != "lm_head"}, bases, roots=roots)
    globals_["lm_head"] = heads
    layout = Layout(
        family=name,
        globals=globals_,
        layer=rebase(lay.layer, bases, layers, roots),
        expert=rebase(lay.expert, bases, layers, roots),
        fused=rebase(lay.fused, bases, layers, roots),
        fused_format=str(changes.pop("fused_format", lay.fused_format)),
        notes=f"{audits}; {lay.notes}",
        left_out={**lay.left_out, **left_out},
    )
    return dataclasses.replace(text, name=name, layout=layout, torchtitan=(), audits=audits, **changes)  # type: ignore[arg-type]
