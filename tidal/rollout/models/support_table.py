"""The README's table of model families and the engine features each supports, derived from the registry.

Every cell comes from the family's record (``registry.Family.refuses`` and ``Family.exact``), so the table
cannot drift from what the engine does: ``tests/rollout/test_support_table.py`` checks that README.md holds
exactly this table. After adding a family, print it with ``python -m tidal.rollout.models.support_table``
and paste it between the README's markers.
"""

from __future__ import annotations

from tidal.rollout.models.registry import FAMILIES, VISION_FAMILIES, Family

BEGIN = "<!-- families: python -m tidal.rollout.models.support_table -->"
END = "<!-- /families -->"
# (column title, registry feature); a refused cuda_graphs / async_scheduling runs eager / synchronous.
COLUMNS = (
    ("tensor parallel", "tensor_parallel"),
    ("prefix caching", "prefix_caching"),
    ("chunked prefill", "chunked_prefill"),
    ("CUDA graphs", "cuda_graphs"),
    ("async scheduling", "async_scheduling"),
    ("packed training", "packing_samples"),
)


def _row(entry: Family, kind: str) -> str:
    cells = ["no" if feature in entry.refuses else "yes" for _, feature in COLUMNS]
    exact = [name for device, name in (("cpu", "CPU"), ("cuda", "CUDA")) if device in entry.exact]
    cells.append(" + ".join(exact) if exact else "no")
    return f"| `{entry.model_type}` | {kind} | " + " | ".join(cells) + " |"


def support_table() -> str:
    """The markdown table, with its markers: one row per registered family, text then vision-language."""
    header = "| family | kind | " + " | ".join(title for title, _ in COLUMNS) + " | exact log-probs |"
    rule = "|" + "---|" * (len(COLUMNS) + 3)
    rows = [_row(entry, "text") for entry in FAMILIES.values()]
    rows += [_row(entry, "vision-language") for entry in VISION_FAMILIES.values()]
    return "\n".join([BEGIN, header, rule, *rows, END])


if __name__ == "__main__":
    print(support_table())
