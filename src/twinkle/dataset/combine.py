"""Several loaded datasets as one: concatenated, or interleaved round robin or by ratios."""

from collections.abc import Sequence

import datasets

from twinkle.utils.errors import UserError

STOPPING_STRATEGIES = ("first_exhausted", "all_exhausted")


def align(parts: Sequence[datasets.Dataset]) -> list[datasets.Dataset]:
    """Cast every part to the first one's column types; parts with other columns are an error."""
    reference = parts[0].features
    aligned = []
    for i, part in enumerate(parts):
        if part.features != reference:
            if sorted(part.column_names) != sorted(reference):
                raise UserError(
                    f"the added datasets have different columns ({sorted(reference)} and dataset {i}: "
                    f"{sorted(part.column_names)}); map them to the same columns first "
                    "(dataset.map(fn, dataset_meta=<its DatasetMeta>))"
                )
            try:
                part = part.cast(reference)
            except Exception as exc:
                raise UserError(
                    f"dataset {i}'s columns cannot take the first dataset's types ({str(exc).splitlines()[0][:160]}); "
                    "map them to the same value types first"
                ) from exc
        aligned.append(part)
    return aligned


def concatenate(parts: Sequence[datasets.Dataset]) -> datasets.Dataset:
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(align(parts))


def interleave(
    parts: Sequence[datasets.Dataset],
    ratios: Sequence[float] | None,
    seed: int,
    stopping_strategy: str,
) -> datasets.Dataset:
    """One row from each part in turn, or (with ``ratios``) a part drawn at random with those
    weights, the draws fixed by ``seed``. ``first_exhausted`` stops when one part runs out;
    ``all_exhausted`` goes on, repeating parts, until every row has been used."""
    if stopping_strategy not in STOPPING_STRATEGIES:
        raise UserError(
            f"mix_dataset: stopping_strategy {stopping_strategy!r} is not one of {', '.join(STOPPING_STRATEGIES)}"
        )
    probabilities = None
    if ratios is not None:
        ratios = [float(r) for r in ratios]
        if len(ratios) != len(parts) or min(ratios) < 0 or sum(ratios) <= 0:
            raise UserError(
                f"mix_dataset: ratios needs one non-negative weight per dataset ({len(parts)}), not all 0; got {ratios}"
            )
        probabilities = [r / sum(ratios) for r in ratios]
    return datasets.interleave_datasets(
        align(parts), probabilities=probabilities, seed=seed, stopping_strategy=stopping_strategy
    )
