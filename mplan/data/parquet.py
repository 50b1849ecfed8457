"""Parquet input of `mplan data prepare`: one document per row, from one string column.

What: `check(path, column)` reads a file's footer (its schema, not its data) and refuses what
cannot give documents, in one `DataError` line naming the file and the cause: pyarrow not
installed, a file that is not parquet or lost its footer (truncated), no such column, a column
that does not hold text (string, large_string, or a dictionary of either). `documents(path,
column)` then yields the column's values row by row, one record batch in memory at a time; a
null row is left out, as an empty document is. Data that turns out corrupt past the footer (a
damaged page) is refused in the same one line when reading reaches it.

Why a check apart from the reading: `prepare` checks every parquet input before it creates the
output directory and trains a tokenizer, so a wrong file is named within a second and leaves
nothing behind, not after minutes of tokenizer training.

pyarrow is imported here only, and only once a parquet file is given: mplan does not require it.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mplan.data.errors import DataError

SHOWN_COLUMNS = 10
"""Column names a refusal lists when the wanted column is missing (wide tables have hundreds)."""


def check(path: str, column: str) -> None:
    """Refuse `path` unless it is parquet with a text `column` (module docstring)."""
    pa, pq = _pyarrow(path)
    try:
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as exc:
        raise _unreadable(path, exc) from None
    if column not in schema.names:
        names = ", ".join(schema.names[:SHOWN_COLUMNS]) + (", ..." if len(schema.names) > SHOWN_COLUMNS else "")
        raise DataError(f"{path}: has no column {column!r} (its columns: {names or 'none'})")
    kind = schema.field(schema.names.index(column)).type
    values = kind.value_type if pa.types.is_dictionary(kind) else kind
    if not (pa.types.is_string(values) or pa.types.is_large_string(values)):
        raise DataError(f"{path}: column {column!r} holds {kind}, not text (strings)")


def documents(path: str, column: str) -> Iterator[str]:
    """The non-null values of `column`, in row order (`check` has accepted the file)."""
    pa, pq = _pyarrow(path)
    try:
        for batch in pq.ParquetFile(path).iter_batches(columns=[column]):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)
    except (OSError, pa.ArrowException) as exc:
        raise _unreadable(path, exc) from None


def _pyarrow(path: str) -> tuple[Any, Any]:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(f"{path}: reading parquet needs pyarrow, which is not installed "
                        f"(pip install pyarrow, or convert the file to JSONL)") from None
    return pyarrow, pyarrow.parquet


def _unreadable(path: str, exc: BaseException) -> DataError:
    # pyarrow's messages can span lines ("Couldn't deserialize thrift: ...\nDeserializing page
    # header failed."): joined, so the refusal stays one line
    return DataError(f"{path}: cannot read as parquet: {' '.join(str(exc).split())}")
