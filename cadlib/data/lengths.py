"""A user's document lengths, read from a file.

Formats, chosen by the path (:func:`length_format`):

* ``.txt``: one integer per line; blank lines and lines starting with ``#`` are skipped;
* ``.csv``: a column of a comma-separated file whose first row names the columns (a one-column file
  whose first row is an integer has no header);
* ``.jsonl``: one JSON object per line, the value under ``column`` (a number, or a list such as token
  ids, whose length is taken); without ``column`` each line may be a bare number or list;
* ``.parquet``: a column, integers or lists (their lengths), read with ``pyarrow``;
* ``.npy``: a one-dimensional array of integers (floats holding whole numbers are accepted);
* a directory written by Hugging Face ``datasets``' ``save_to_disk``: a column of integers, or the lengths
  of a list column such as ``input_ids``, read with ``datasets.load_from_disk`` (the ``data`` extra).

``column`` may be left out when the file has one column. Lengths must be integers ``>= 1``; a file with
none, a value that is not one, or a missing column is a ValueError naming the file and what is valid.
Text formats are parsed in blocks by numpy; the slow path that names the offending line runs only
when a block fails.

Batches are drawn from the lengths read by :func:`cadlib.data.workload.sample_lengths`.
"""
from __future__ import annotations

import csv
import io
import json
import os
import pathlib
import re

import numpy as np

FORMATS: tuple[str, ...] = ("txt", "csv", "jsonl", "parquet", "npy", "datasets")
SUFFIXES = {".txt": "txt", ".csv": "csv", ".jsonl": "jsonl", ".parquet": "parquet", ".npy": "npy"}
BLOCK_BYTES = 1 << 24
"""Bytes of a ``.txt`` file parsed at once."""


def length_format(path: str | os.PathLike) -> str:
    """The format of ``path``: by its suffix, or ``datasets`` for a directory ``save_to_disk`` wrote."""
    p = pathlib.Path(path)
    if p.is_dir():
        if any((p / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
            return "datasets"
        raise ValueError(f"{p} is a directory but not a saved dataset (no dataset_info.json, state.json or "
                         "dataset_dict.json); give a directory written by datasets' save_to_disk")
    if not p.exists():
        raise ValueError(f"{p} does not exist; give a lengths file ({', '.join(SUFFIXES)}) or a saved "
                         "dataset")
    fmt = SUFFIXES.get(p.suffix.lower())
    if fmt is None:
        raise ValueError(f"{p}: unknown suffix {p.suffix!r}; lengths files are {', '.join(SUFFIXES)} or a "
                         "directory written by datasets' save_to_disk")
    return fmt


def read_lengths(path: str | os.PathLike, column: str | None = None) -> np.ndarray:
    """The document lengths in ``path`` (int64, in file order); see the module docstring for formats."""
    fmt = length_format(path)
    if column is not None and fmt in ("txt", "npy"):
        raise ValueError(f"column={column!r} applies to csv, jsonl, parquet and datasets, not a .{fmt} file")
    reader = {"txt": _read_txt, "csv": _read_csv, "jsonl": _read_jsonl, "parquet": _read_parquet,
              "npy": _read_npy, "datasets": _read_datasets}[fmt]
    out = reader(pathlib.Path(path)) if fmt in ("txt", "npy") else reader(pathlib.Path(path), column)
    if out.size == 0:
        raise ValueError(f"{path} holds no lengths; give at least one integer length >= 1")
    return out


# ---------------------------------------------------------------------------------------------------
# Text formats
# ---------------------------------------------------------------------------------------------------

def _to_int64(values) -> np.ndarray | None:
    """``values`` (byte or str tokens, or ints) as int64, or None when one is not an integer."""
    try:
        return np.asarray(values).astype(np.int64)
    except (ValueError, OverflowError, TypeError):
        return None


def _bad_value(v) -> str | None:
    """Why one token is not a length (None when it is one)."""
    shown = v.decode(errors="replace") if isinstance(v, bytes) else str(v)
    try:
        n = int(shown.strip())
    except (ValueError, OverflowError):
        return f"holds {shown!r}, not an integer"
    return None if n >= 1 else f"holds {n}"


def _as_ints(values, where) -> np.ndarray:
    """``values`` as int64 lengths >= 1, or a ValueError naming the first bad one by ``where(i)``."""
    out = _to_int64(values)
    if out is None or np.any(out < 1):
        for i, v in enumerate(values):
            why = _bad_value(v)
            if why:
                raise ValueError(f"{where(i)} {why}; lengths must be integers >= 1")
    return out


def _check_positive(out: np.ndarray, where) -> None:
    bad = np.flatnonzero(out < 1)
    if bad.size:
        raise ValueError(f"{where(int(bad[0]))} holds {int(out[bad[0]])}; lengths must be integers >= 1")


_TWO_ON_A_LINE = re.compile(rb"\S[ \t]+\S")


def _blocks(path: pathlib.Path):
    """``path`` in blocks of about ``BLOCK_BYTES`` bytes, each ending at a line end (the last one at EOF)."""
    carry = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(BLOCK_BYTES)
            data = carry + block
            cut = data.rfind(b"\n") + 1 if block else len(data)
            data, carry = data[:cut], data[cut:]
            if data:
                yield data
            if not block:
                return


def _read_txt(path: pathlib.Path) -> np.ndarray:
    """Blocks of whole lines split on whitespace and converted by numpy; a block that fails (a token
    that is no integer, a length < 1, two values on a line) is rescanned line by line to name it."""
    parts = []
    for data in _blocks(path):
        if b"#" in data:
            data = b"\n".join(s for s in data.split(b"\n") if not s.lstrip().startswith(b"#"))
        tokens = data.split()
        if tokens:
            out = _to_int64(tokens)
            if out is None or np.any(out < 1) or _TWO_ON_A_LINE.search(data):
                _locate_txt(path)
            parts.append(out)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _locate_txt(path: pathlib.Path) -> None:
    """Raise the ValueError naming the first line of ``path`` that is not one length."""
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            s = line.strip()
            if not s or s.startswith(b"#"):
                continue
            why = "holds more than one value" if len(s.split()) > 1 else _bad_value(s)
            if why:
                raise ValueError(f"{path} line {lineno} {why}; give one integer length >= 1 per line")
    raise AssertionError(f"{path}: a block failed to parse but no line is bad")


def _pick_column(path, column: str | None, names: list[str]) -> str:
    if column is not None:
        if column not in names:
            raise ValueError(f"{path} has no column {column!r}; its columns are: "
                             f"{', '.join(map(str, names))}")
        return column
    if len(names) != 1:
        raise ValueError(f"{path} has {len(names)} columns ({', '.join(map(str, names))}); name the one that "
                         "holds the lengths (column=...)")
    return names[0]


def _read_csv(path: pathlib.Path, column: str | None) -> np.ndarray:
    with open(path, newline="") as f:
        rows = csv.reader(f)
        header = next(rows, None)
        if header is None:
            return np.zeros(0, dtype=np.int64)
        headerless = len(header) == 1 and column is None and header[0].strip().lstrip("+-").isdigit()
        first = 1 if headerless else 2
        values = [header[0]] if headerless else []
        j = 0 if headerless else header.index(_pick_column(path, column, header))
        for k, row in enumerate(rows):
            if not row:
                values.append("")
            elif j >= len(row):
                raise ValueError(f"{path} row {k + first} has {len(row)} fields, none under column "
                                 f"{header[j]!r}")
            else:
                values.append(row[j])
    values = [v.strip() for v in values]
    return _as_ints(values, lambda i: f"{path} row {i + (1 if headerless else 2)}")


class _Odd(Exception):
    """A block of JSON lines the fast path does not take; the line-by-line reader names the problem."""


def _read_jsonl(path: pathlib.Path, column: str | None) -> np.ndarray:
    """Blocks of lines decoded as one JSON array each (one C-level decode), values picked by ``column``;
    a block that is not plain (bad JSON, a missing key, a value that is no length) is read again line
    by line, which names the line. With pyarrow installed its JSON reader reads plain files first."""
    plain = _read_jsonl_arrow(path, column)
    if plain is not None:
        return plain
    parts = []
    for data in _blocks(path):
        body = [s for s in data.split(b"\n") if s.strip()]
        if not body:
            continue
        try:
            objs = json.loads(b"[" + b",".join(body) + b"]")
            parts.append(_json_values(objs, column))
        except (json.JSONDecodeError, _Odd, KeyError, TypeError, ValueError):
            return _read_jsonl_lines(path, column)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _read_jsonl_arrow(path: pathlib.Path, column: str | None) -> np.ndarray | None:
    """pyarrow's reading of a plain JSON-lines file (objects with an integer or list column and no
    gaps); None when pyarrow is missing or the file is not plain."""
    try:
        import pyarrow as pa
        import pyarrow.json as pj
    except ImportError:
        return None
    try:
        tbl = pj.read_json(path)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    name = _pick_column(path, column, tbl.column_names)
    col = tbl.column(name)
    if not (pa.types.is_integer(col.type) or pa.types.is_list(col.type)) or col.null_count:
        return None
    try:
        return _arrow_lengths(col, path, name)
    except ValueError:                     # a length < 1: the line reader names its line
        return None


def _json_values(objs: list, column: str | None) -> np.ndarray:
    if all(isinstance(o, dict) for o in objs):
        key = column if column is not None else next(iter(objs[0]), None)
        if key is None or (column is None and any(len(o) != 1 for o in objs)):
            raise _Odd
        vals = [o[key] for o in objs]
    elif column is None:
        vals = objs
    else:
        raise _Odd
    if all(type(v) is int for v in vals):
        out = np.asarray(vals, dtype=np.int64)
    elif all(isinstance(v, list) for v in vals):
        out = np.fromiter((len(v) for v in vals), dtype=np.int64, count=len(vals))
    else:
        raise _Odd
    if out.size and out.min() < 1:
        raise _Odd
    return out


def _read_jsonl_lines(path: pathlib.Path, column: str | None) -> np.ndarray:
    out, lines = [], []
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {lineno} is not JSON ({e.msg}); give one object per "
                                 "line") from None
            if isinstance(obj, dict):
                key = _pick_column(f"{path} line {lineno}", column, list(obj))
                obj = obj[key]
            elif column is not None:
                raise ValueError(f"{path} line {lineno} is not an object, so it has no column {column!r}")
            out.append(_length_of(obj, lambda: f"{path} line {lineno}"))
            lines.append(lineno)
    return _as_ints(out, lambda i: f"{path} line {lines[i]}")


def _length_of(v, where):
    """An integer value as it is, a list's length; anything else a ValueError."""
    if isinstance(v, bool) or v is None:
        raise ValueError(f"{where()} holds {v!r}, not an integer; lengths must be integers >= 1")
    if isinstance(v, list):
        return len(v)
    if isinstance(v, float):
        if not v.is_integer():
            raise ValueError(f"{where()} holds {v!r}, not an integer; lengths must be integers >= 1")
        return int(v)
    if isinstance(v, int):
        return v
    raise ValueError(f"{where()} holds {v!r}, not an integer; lengths must be integers >= 1")


# ---------------------------------------------------------------------------------------------------
# Binary formats
# ---------------------------------------------------------------------------------------------------

def _read_npy(path: pathlib.Path) -> np.ndarray:
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise ValueError(f"{path} is not a plain .npy array ({e}); save lengths with numpy.save") from None
    if arr.ndim != 1:
        raise ValueError(f"{path} holds an array of shape {arr.shape}; lengths must be one-dimensional")
    return _numeric(np.asarray(arr), lambda i: f"{path} index {i}")


def _numeric(arr: np.ndarray, where) -> np.ndarray:
    """A numeric array as int64 lengths >= 1 (floats must hold whole numbers)."""
    if arr.dtype.kind in "iu":
        out = arr.astype(np.int64)
    elif arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            raise ValueError(f"{where(int(bad[0]))} holds {arr[bad[0]]!r}, not an integer; lengths must be "
                             "integers >= 1")
        out = arr.astype(np.int64)
    else:
        raise ValueError(f"{where(0)}: values of type {arr.dtype} are not integers; lengths must be "
                         "integers >= 1")
    _check_positive(out, where)
    return out


def _arrow_lengths(col, path, name: str) -> np.ndarray:
    """A pyarrow column (array or chunked array) as lengths: list lengths for a list column."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    def where(i):
        return f"{path} column {name!r} row {i + 1}"

    if col.null_count:
        i = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"{where(i)} is empty (null); lengths must be integers >= 1")
    t = pa.types
    if t.is_list(col.type) or t.is_large_list(col.type) or t.is_fixed_size_list(col.type):
        out = pc.list_value_length(col).to_numpy(zero_copy_only=False).astype(np.int64)
        _check_positive(out, where)
        return out
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        return _numeric(col.to_numpy(zero_copy_only=False), where)
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
        return _as_ints(col.to_pylist(), where)
    raise ValueError(f"{path} column {name!r} is of type {col.type}; give a column of integer lengths or of "
                     "lists (token ids) whose lengths are taken")


def _read_parquet(path: pathlib.Path, column: str | None) -> np.ndarray:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow; install it (pip install pyarrow, or cadlib's "
                         "'data' extra)") from None
    names = pq.read_schema(path).names
    name = _pick_column(path, column, names)
    return _arrow_lengths(pq.read_table(path, columns=[name]).column(name), path, name)


def _read_datasets(path: pathlib.Path, column: str | None) -> np.ndarray:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{path} is a saved dataset; reading it needs the datasets package (pip install "
                         "'cadlib[data]' or pip install datasets)") from None
    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        splits = list(ds)
        if len(splits) == 1 or "train" in splits:
            ds = ds["train" if "train" in splits else splits[0]]
        else:
            raise ValueError(f"{path} holds the splits {', '.join(splits)} and none is 'train'; save one "
                             "split")
    name = _pick_column(path, column, list(ds.column_names))
    return _arrow_lengths(ds.with_format("arrow")[name], path, name)


# ---------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------

def write_lengths(path: str | os.PathLike, lengths, header: str = "") -> pathlib.Path:
    """``lengths`` as a ``.txt`` lengths file, one per line, after ``header`` (each line prefixed ``# ``)."""
    arr = np.asarray(lengths, dtype=np.int64)
    buf = io.StringIO()
    for line in header.splitlines():
        buf.write(f"# {line}\n")
    np.savetxt(buf, arr, fmt="%d")
    p = pathlib.Path(path)
    p.write_text(buf.getvalue())
    return p
