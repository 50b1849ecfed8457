"""Parquet input to `mplan data prepare`: a file's 'text' column gives the same tokens as the same
documents in JSONL, and a file that cannot give documents (no such column, not text, not parquet,
truncated, damaged inside, pyarrow missing) is refused in one line naming the file and the cause.

The parquet files are written here with pyarrow; the JSONL twin holds the same documents, so the
two preparations must agree to the byte: same trained tokenizer, same shards, same fingerprint.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mplan.data import TokenShards, prepare
from test_data import RECORDS, TEXTS

VOCAB = 320
DOCUMENTS = [*TEXTS.values(), *RECORDS]
"""Unicode, code, numbers, an empty text and an empty record (left out by prepare, both ways)."""


def _prepare_jsonl(tmp_path, documents: list[str]) -> TokenShards:
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents), encoding="utf-8")
    prepare(str(path), str(tmp_path / "from-jsonl"), vocab_size=VOCAB, shard_tokens=200)
    return TokenShards.open(str(tmp_path / "from-jsonl"))


@pytest.mark.parametrize("text_type", [pa.string(), pa.large_string(), pa.dictionary(pa.int32(), pa.string())],
                         ids=["string", "large_string", "dictionary"])
def test_parquet_gives_the_tokens_of_the_same_documents_in_jsonl(tmp_path, text_type) -> None:
    rows = [*DOCUMENTS[:3], None, *DOCUMENTS[3:]]  # a null row is left out, as an empty document is
    texts = pa.array(rows, pa.string())
    table = pa.table({"id": list(range(len(rows))),
                      "text": texts.dictionary_encode() if pa.types.is_dictionary(text_type) else texts.cast(text_type)})
    assert table.schema.field("text").type == text_type
    path = tmp_path / "docs.parquet"
    pq.write_table(table, path, row_group_size=3)  # several row groups: documents cross batches in order
    summary = prepare(str(path), str(tmp_path / "from-parquet"), vocab_size=VOCAB, shard_tokens=200)
    from_parquet = TokenShards.open(str(tmp_path / "from-parquet"))
    from_jsonl = _prepare_jsonl(tmp_path, DOCUMENTS)
    assert summary["num_documents"] == from_jsonl.num_documents == len([d for d in DOCUMENTS if d])
    assert len(from_parquet.shards) > 1
    assert np.array_equal(from_parquet.read(0, from_parquet.num_tokens), from_jsonl.read(0, from_jsonl.num_tokens))
    assert from_parquet.fingerprint == from_jsonl.fingerprint  # the trained tokenizers are the same too
    assert from_parquet.tokenizer().decode(from_parquet.document(0)[:-1].tolist()) == DOCUMENTS[0]


def _damaged_inside(path) -> None:
    """Overwrite every byte between the leading magic and the footer: the schema still reads, the
    first page header does not."""
    data = bytearray(path.read_bytes())
    footer = int.from_bytes(data[-8:-4], "little") + 8
    data[4:len(data) - footer] = b"\x07" * (len(data) - footer - 4)
    path.write_bytes(bytes(data))


def _write(tmp_path, kind: str):
    """A parquet file of `kind`: one of the refused kinds below, or 'good'."""
    path = tmp_path / f"{kind}.parquet"
    if kind == "no_text_column":
        pq.write_table(pa.table({"body": ["a document"], "id": [1]}), path)
    elif kind == "numbers":
        pq.write_table(pa.table({"text": [1, 2, 3]}), path)
    elif kind == "bytes":
        pq.write_table(pa.table({"text": pa.array([b"raw"], pa.binary())}), path)
    elif kind == "not_parquet":
        path.write_text("a text file that only ends in .parquet\n" * 20)
    else:
        pq.write_table(pa.table({"text": [f"document {i} " * 20 for i in range(200)]}), path)
        if kind == "truncated":
            path.write_bytes(path.read_bytes()[:path.stat().st_size // 2])
        elif kind == "damaged_inside":
            _damaged_inside(path)
    return path


@pytest.mark.parametrize("kind, cause", [
    ("no_text_column", "has no column 'text' (its columns: body, id)"),
    ("numbers", "column 'text' holds int64, not text (strings)"),
    ("bytes", "column 'text' holds binary, not text (strings)"),
    ("not_parquet", "cannot read as parquet: Parquet magic bytes not found"),
    ("truncated", "cannot read as parquet: Parquet magic bytes not found"),
    ("damaged_inside", "cannot read as parquet: "),
])
def test_a_file_that_cannot_give_documents_is_one_line_naming_it(tmp_path, capsys, kind, cause) -> None:
    from mplan.cli import main
    from mplan.data import DataError

    path = _write(tmp_path, kind)
    out = tmp_path / "tokens"
    with pytest.raises(DataError) as caught:  # the library's message is one line already (pyarrow's may not be)
        prepare(str(path), str(out), vocab_size=VOCAB)
    assert str(caught.value).startswith(f"{path}: {cause}") and "\n" not in str(caught.value)
    if kind != "damaged_inside":  # refused from the footer, before anything was written
        assert not out.exists()
    assert main(["data", "prepare", str(path), "-o", str(tmp_path / "cli"), "-q"]) == 2
    assert capsys.readouterr().err == f"mplan data: error: {caught.value}\n"


def test_without_pyarrow_parquet_is_refused_in_one_line_and_text_still_prepares(tmp_path, monkeypatch) -> None:
    from mplan.data import DataError

    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as if not installed: importing it fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = _write(tmp_path, "good")
    with pytest.raises(DataError) as caught:
        prepare(str(path), str(tmp_path / "tokens"), vocab_size=VOCAB)
    assert str(caught.value) == (f"{path}: reading parquet needs pyarrow, which is not installed "
                                 f"(pip install pyarrow, or convert the file to JSONL)")
    assert not (tmp_path / "tokens").exists()
    (tmp_path / "doc.txt").write_text(DOCUMENTS[0], encoding="utf-8")
    assert prepare(str(tmp_path / "doc.txt"), str(tmp_path / "text"), vocab_size=VOCAB)["num_documents"] == 1


def test_mplan_imports_without_pyarrow() -> None:
    """pyarrow is a dev extra, not a dependency: nothing in mplan imports it until parquet is read."""
    code = ("import sys; sys.modules['pyarrow'] = None\n"
            "import mplan, mplan.cli, mplan.data, mplan.data.prepare_command, mplan.train.run\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
