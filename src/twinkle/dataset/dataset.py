"""``Dataset``: load -> map(preprocessor) -> set_template -> encode, on Hugging Face ``datasets``."""

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import datasets

from twinkle.dataset import combine, image_rows
from twinkle.dataset.encode import encode_dataset
from twinkle.dataset.export import save_rows
from twinkle.dataset.meta import DatasetMeta, load_rows, schema_of, with_schema
from twinkle.dataset.ops import filter_rows, map_rows, reject_unsupported, resolve_function
from twinkle.dataset.origin import RowOrigin, bad_rows_text, report_skipped
from twinkle.dataset.pairs import holds_pairs
from twinkle.template import Template, get_template
from twinkle.template.tokenizer import load_tokenizer
from twinkle.utils.errors import UserError
from twinkle.utils.logger import get_logger

logger = get_logger()


class Dataset:
    """Rows that become encoded samples. Methods change the dataset in place and return ``self``.

    It may hold several datasets (``add_dataset``): ``map`` and ``filter`` take a
    ``dataset_meta`` to work on one of them, and ``mix_dataset`` interleaves them. Until then the
    rows read as the datasets one after another (``len``, indexing, ``encode``, ``save_as``).

    A row that cannot become a training sample (a preprocessor's ``BadRow``: a value of the
    wrong type, empty text, unknown roles, no assistant turn; or nothing left to learn after the
    template) is an error naming its file, line and field. With ``skip_bad_rows`` such rows are
    dropped instead, and each step that drops some logs one line with their count and the first
    few. ``skip_bad_rows=None`` takes the run's configuration (``--skip-bad-rows`` once
    ``twinkle.initialize()`` applied the command line; else False)."""

    def __init__(
        self, dataset_meta: DatasetMeta | None = None, skip_bad_rows: bool | None = None, features: Any = None
    ):
        """``features``: a ``datasets.Features`` schema (upstream's cookbooks give one for image
        columns); each dataset loaded has the columns it names cast to its types (``with_schema``).
        Image columns need none: ``map`` stores the images it gets (``twinkle.dataset.image_rows``)."""
        self._schema = schema_of(features)
        self.template: Template | None = None
        from twinkle.runtime import run_defaults

        defaults = run_defaults()  # the run's configuration, read once, here
        self.skip_bad_rows = defaults.skip_bad_rows if skip_bad_rows is None else skip_bad_rows
        self.seed = defaults.seed  # what ``mix_dataset`` draws with unless given a seed
        # (DatasetMeta.get_id() or None once several were merged, rows); and where each row came from
        self._parts: list[tuple[str | None, datasets.Dataset]] = []
        self._origins: list[RowOrigin] = []
        self._joined: datasets.Dataset | None = None
        self._pixels_on_read = False  # encoded with a vision template: a read makes the image tensors
        if dataset_meta is not None:
            self.add_dataset(dataset_meta)

    @property
    def data(self) -> datasets.Dataset:
        """All rows as one ``datasets.Dataset``."""
        if not self._parts:
            raise UserError("this Dataset holds no rows; pass a DatasetMeta or call add_dataset(...)")
        if self._joined is None:
            self._joined = combine.concatenate([rows for _, rows in self._parts])
        return self._joined

    def _replace_all(self, rows: datasets.Dataset, origin: RowOrigin) -> None:
        key = self._parts[0][0] if len(self._parts) == 1 else None
        self._parts, self._origins, self._joined = [(key, rows)], [origin], rows

    def __len__(self) -> int:
        return sum(len(rows) for _, rows in self._parts)

    def __getitem__(self, index: int) -> dict[str, Any]:
        row = self.data[index]
        if self._pixels_on_read and hasattr(index, "__index__"):  # one row, not a slice of columns
            return image_rows.with_pixels(row, self.template, int(index))
        return row

    def add_dataset(self, dataset_meta: "DatasetMeta | Dataset") -> "Dataset":
        """Load another dataset (a ``DatasetMeta``, or the rows of another ``Dataset``) next to these."""
        if isinstance(dataset_meta, DatasetMeta):
            rows, origin = load_rows(dataset_meta, self.skip_bad_rows)
            if self._schema is not None:
                name = dataset_meta.dataset_id if dataset_meta.data is None else "DatasetMeta(data=...)"
                rows = with_schema(rows, self._schema, str(name or "the bundled rows"))
            self._parts.append((dataset_meta.get_id(), rows))
            self._origins.append(origin)
        elif isinstance(dataset_meta, Dataset):
            self._parts += dataset_meta._parts
            self._origins += dataset_meta._origins
        else:
            raise UserError(
                f"add_dataset takes a DatasetMeta or a Dataset, got {type(dataset_meta).__name__}"
            )
        self._joined = None
        return self

    def _selected(self, dataset_meta: DatasetMeta | None, method: str) -> list[int]:
        if not self._parts:
            raise UserError(
                f"Dataset.{method}: this Dataset holds no rows; pass a DatasetMeta or call add_dataset(...)"
            )
        if dataset_meta is None:
            return list(range(len(self._parts)))
        key = dataset_meta.get_id()
        chosen = [i for i, (k, _) in enumerate(self._parts) if k == key]
        if not chosen:
            known = [k for k, _ in self._parts if k is not None]
            raise UserError(
                f"Dataset.{method}: no added dataset is {key!r} (added: {known or 'none'}); mixed or encoded "
                f"datasets are one, call {method}() on them without dataset_meta"
            )
        return chosen

    def map(
        self,
        preprocess_func: Callable[..., Any] | str | type,
        dataset_meta: DatasetMeta | None = None,
        init_args: dict[str, Any] | None = None,
        batched: bool = False,
        batch_size: int = 1000,
        remove_columns: Sequence[str] | str | None = None,
        num_proc: int | None = None,
        load_from_cache_file: bool = False,
        **unsupported: Any,
    ) -> "Dataset":
        """Transform rows with a function, a preprocessor instance, a preprocessor class (built
        with ``init_args``) or the name of one in ``twinkle.preprocessor``.

        A function gets each row (``batched=False``) or a dict of column lists (``batched=True``);
        what it returns is merged into the row, minus ``remove_columns``; a row function that
        returns ``None`` drops the row. A ``Preprocessor``'s output replaces all of the row's
        columns, so raw fields do not reach the template: one written per row (``preprocess``)
        runs row by row, whatever ``batched`` says, so its ``BadRow`` names the row; one written
        in upstream's shape (``__call__(columns)``) gets ``batch_size`` rows as columns with
        ``batched=True``, one row as columns otherwise. ``load_from_cache_file=True`` maps again
        (logged): only ``encode`` caches. ``dataset_meta`` picks one of the datasets added with
        ``add_dataset``."""
        reject_unsupported("map", unsupported)
        if load_from_cache_file:
            logger.info(
                "Dataset.map(load_from_cache_file=True): rows are mapped again (a cache keyed by the "
                "function could not see a change in its code); encode(load_from_cache_file=True) caches"
            )
        fn = resolve_function(preprocess_func, init_args, "map")
        for i in self._selected(dataset_meta, "map"):
            key, rows = self._parts[i]
            mapped, origin, bad = map_rows(
                rows, fn, batched, batch_size, remove_columns, num_proc, self._origins[i], self.skip_bad_rows
            )
            report_skipped(bad_rows_text(bad, self._origins[i]), len(bad), len(rows), "map")
            self._parts[i], self._origins[i] = (key, mapped), origin
        self._joined = None
        return self

    def filter(
        self,
        filter_func: Callable[..., Any] | type,
        dataset_meta: DatasetMeta | None = None,
        init_args: dict[str, Any] | None = None,
        batched: bool = False,
        batch_size: int = 1000,
        num_proc: int | None = None,
        **unsupported: Any,
    ) -> "Dataset":
        """Keep the rows for which ``filter_func(row)`` is true (with ``batched``, it gets a dict of
        column lists and returns one bool per row): a function, a ``DataFilter`` instance, a class
        built with ``init_args``, or the name of a ``DataFilter`` in ``twinkle.preprocessor``."""
        reject_unsupported("filter", unsupported)
        fn = resolve_function(filter_func, init_args, "filter")
        for i in self._selected(dataset_meta, "filter"):
            key, rows = self._parts[i]
            kept = filter_rows(rows, fn, batched, batch_size, num_proc)
            if len(kept) != len(rows):  # which rows it kept is not known: number them anew
                self._origins[i] = RowOrigin.in_place("the rows after Dataset.filter", len(kept))
            self._parts[i] = (key, kept)
        self._joined = None
        return self

    def mix_dataset(
        self,
        interleave: bool = True,
        ratios: Sequence[float] | None = None,
        seed: int | None = None,
        stopping_strategy: str = "first_exhausted",
    ) -> "Dataset":
        """Merge the added datasets into one: interleaved (one row of each in turn, or drawn with
        the weights ``ratios``, fixed by ``seed``, default the run's seed) or, with
        ``interleave=False``, concatenated. ``stopping_strategy`` ``first_exhausted`` stops with the
        shortest dataset; ``all_exhausted`` repeats datasets until each is used up."""
        if not interleave and ratios is not None:
            raise UserError("mix_dataset: ratios weight an interleave; drop ratios or pass interleave=True")
        if len(self._parts) < 2:
            logger.info("mix_dataset: one dataset, nothing to mix")
            return self
        parts = [rows for _, rows in self._parts]
        if interleave:
            seed = self.seed if seed is None else seed
            mixed = combine.interleave(parts, ratios, seed, stopping_strategy)
            self._replace_all(mixed, RowOrigin.in_place("the mixed rows", len(mixed)))
        else:
            self._replace_all(combine.concatenate(parts), RowOrigin.concat(self._origins))
        return self

    def set_template(
        self,
        template_cls: str | type[Template] | Template = "Template",
        model_id: str | None = None,
        max_length: int = 1024,
        truncation_strategy: str = "right",
        enable_thinking: bool | None = None,
        default_system: str | None = None,
        use_chat_template: bool | None = None,
        **unsupported: Any,
    ) -> "Dataset":
        """Choose how rows become tokens: a template name, class or built instance; the tokenizer
        comes from ``model_id`` (None: the bundled model). See ``Template`` for the options."""
        reject_unsupported("set_template", unsupported)
        if isinstance(template_cls, Template):
            given = {
                "model_id": model_id is not None,
                "max_length": max_length != 1024,
                "truncation_strategy": truncation_strategy != "right",
                "enable_thinking": enable_thinking is not None,
                "default_system": default_system is not None,
                "use_chat_template": use_chat_template is not None,
            }
            named = [name for name, set_ in given.items() if set_]
            if named:
                raise UserError(
                    f"set_template: a built template carries its own settings; pass its class to set {', '.join(named)}"
                )
            self.template = template_cls
            return self
        options = {
            "enable_thinking": enable_thinking,
            "default_system": default_system,
            "use_chat_template": use_chat_template,
        }
        self.template = get_template(
            template_cls,
            load_tokenizer(model_id),
            max_length=max_length,
            truncation_strategy=truncation_strategy,
            **{name: value for name, value in options.items() if value is not None},
        )
        return self

    def encode(
        self,
        add_generation_prompt: bool = False,
        batched: bool = True,
        batch_size: int = 1000,
        num_proc: int | None = None,
        load_from_cache_file: bool = False,
        **unsupported: Any,
    ) -> "Dataset":
        """Tokenise every conversation into ``input_ids``, ``labels``, ``attention_mask``,
        ``position_ids`` and ``length``; rows dropped by ``truncation_strategy='delete'`` go.
        A preference row (``positive``/``negative`` trajectories, from a preference
        preprocessor) becomes ``{'positive': sample, 'negative': sample, 'length'}``: both sides
        share the prompt and only the final reply is supervised; ``twinkle.dataset.pairs`` says
        what each truncation strategy does with a pair that is too long.

        ``add_generation_prompt=True`` encodes prompts for a sampler instead (RL): each row's
        system and user turns with the template's generation prompt, no label, the row's other
        columns (``messages``, ``user_data``) kept for the sampler and the reward
        (``twinkle.dataset.prompts``).

        With a vision-language template every image is decoded and processed here (a bad one is
        a bad row), and each sample keeps its pictures as ``map`` stored them (``images``); a
        read runs them through the image processor again, so a sample read holds the tensors
        (``pixel_values``, ``image_grid_thw``, ...) equal to ``LazyDataset``'s for the row, and
        the dataset holds compressed pictures, not the tensors (``twinkle.dataset.image_rows``).

        ``batched`` and ``num_proc`` (capped at the rows and CPUs) only change the speed.
        ``load_from_cache_file=True`` reuses rows encoded before from the same rows, template,
        settings, tokenizer and code (``twinkle.dataset.cache``), and stores them otherwise."""
        reject_unsupported("encode", unsupported)
        if self.template is None:
            raise UserError("call dataset.set_template(...) before dataset.encode()")
        pairs = holds_pairs(self.data.column_names)
        if getattr(self.template, "encodes_images", False) and (add_generation_prompt or pairs):
            what = "prompt rows (add_generation_prompt=True)" if add_generation_prompt else "preference pairs"
            raise UserError(
                f"Dataset.encode: {what} are not supported yet for {type(self.template).__name__}; "
                "encode conversations with replies"
            )
        if "messages" not in self.data.column_names and not (pairs and not add_generation_prompt):
            raise UserError("rows have no 'messages'; call dataset.map(<preprocessor>) before encode()")
        encoded, origin = encode_dataset(
            self.data,
            self.template,
            batched,
            batch_size,
            num_proc,
            load_from_cache_file,
            RowOrigin.concat(self._origins),
            self.skip_bad_rows,
            prompts=add_generation_prompt,
        )
        self._replace_all(encoded, origin)
        self._pixels_on_read = getattr(self.template, "encodes_images", False)
        return self

    def save_as(
        self,
        output_path: str | Path,
        format: str | None = None,
        batch_size: int = 1000,
        mode: str = "immediate",
        **unsupported: Any,
    ) -> Path:
        """Write the rows to ``output_path``: JSON lines (``.jsonl``, ``.json``), ``.csv`` or
        ``.parquet``/``.pq``, by suffix unless ``format`` says. Returns the path written."""
        reject_unsupported("save_as", unsupported)
        if mode != "immediate":
            raise UserError(f"Dataset.save_as: not supported yet: mode={mode!r}; use mode='immediate'")
        return save_rows(self.data, output_path, format, batch_size)

    @property
    def pad_token_id(self) -> int:
        if self.template is None:
            raise UserError("call dataset.set_template(...) first")
        return self.template.pad_token_id
