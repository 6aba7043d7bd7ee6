"""The shape of a quality step: ``step(rows) -> (kept, dropped)``, rows as dicts (or a batch of
columns), each dropped row a copy with ``drop_reason`` set."""

from collections.abc import Mapping
from typing import Any

from twinkle.preprocessor import Preprocessor

Rows = list[dict[str, Any]]


class FilterStep(Preprocessor):
    """A step that keeps or drops whole rows: subclasses implement ``reason(row)``, the reason to
    drop the row (a short snake_case name) or ``None`` to keep it."""

    def reason(self, row: Mapping[str, Any]) -> str | None:
        raise NotImplementedError(f"{type(self).__name__} must implement reason(row)")

    def __call__(self, rows: Any) -> tuple[Rows, Rows]:  # type: ignore[override]
        kept: Rows = []
        dropped: Rows = []
        for row in self.map_col_to_row(rows):
            why = self.reason(row)
            if why is None:
                kept.append(row)
            else:
                dropped.append({**row, "drop_reason": why})
        return kept, dropped


class MapStep(Preprocessor):
    """A step that rewrites rows and drops none: subclasses implement ``rewrite(row) -> row``."""

    def rewrite(self, row: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement rewrite(row)")

    def __call__(self, rows: Any) -> tuple[Rows, Rows]:  # type: ignore[override]
        return [self.rewrite(dict(row)) for row in self.map_col_to_row(rows)], []
