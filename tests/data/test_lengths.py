"""Tests for cadlib.data.lengths: every file format read back as written, bad files named, and the
empirical sampler's token-budget rule and uniforms shared with the named tables."""
import json

import numpy as np
import pytest

from cadlib.data.lengths import length_format, read_lengths, write_lengths
from cadlib.data.workload import empirical_draw, sample_docs, sample_lengths

LENS = np.array([5, 1, 4096, 131072, 77, 3, 65536, 12, 9, 2048], dtype=np.int64)


def _pyarrow():
    return pytest.importorskip("pyarrow", reason="parquet needs pyarrow (the data extra)")


# ---------------------------------------------------------------------------------------------------
# Every format: the lengths read are the lengths written
# ---------------------------------------------------------------------------------------------------

def test_txt_round_trip_with_header_comments_and_blank_lines(tmp_path):
    p = write_lengths(tmp_path / "a.txt", LENS, header="drawn for a test\nsecond line")
    assert p.read_text().startswith("# drawn for a test\n# second line\n")
    assert np.array_equal(read_lengths(p), LENS)
    q = tmp_path / "b.txt"
    q.write_text("# c\n\n 5 \r\n7\n\n# d\n9")                 # CRLF, spaces, no newline at the end
    assert read_lengths(q).tolist() == [5, 7, 9]


def test_txt_read_in_blocks_keeps_every_line(tmp_path, monkeypatch):
    from cadlib.data import lengths
    monkeypatch.setattr(lengths, "BLOCK_BYTES", 7)           # blocks end inside lines
    x = np.arange(1, 2000, dtype=np.int64) * 37
    p = write_lengths(tmp_path / "a.txt", x, header="h")
    assert np.array_equal(read_lengths(p), x)


def test_csv_column_and_headerless_single_column(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text("id,length,text\n" + "".join(f"{i},{n},\"doc, {i}\"\n" for i, n in enumerate(LENS)))
    assert np.array_equal(read_lengths(p, "length"), LENS)
    q = tmp_path / "b.csv"
    q.write_text("".join(f"{n}\n" for n in LENS))
    assert np.array_equal(read_lengths(q), LENS)
    r = tmp_path / "c.csv"
    r.write_text("n_tokens\n" + "".join(f"{n}\n" for n in LENS))
    assert np.array_equal(read_lengths(r), LENS)


def test_jsonl_numbers_lists_and_bare_values(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps({"len": int(n), "input_ids": list(range(int(n) % 50 + 1))}) + "\n"
                         for n in LENS))
    assert np.array_equal(read_lengths(p, "len"), LENS)
    assert np.array_equal(read_lengths(p, "input_ids"), LENS % 50 + 1)
    q = tmp_path / "b.jsonl"
    q.write_text("".join(f"{n}\n" for n in LENS) + "\n")
    assert np.array_equal(read_lengths(q), LENS)


def test_jsonl_without_pyarrow_reads_the_same(tmp_path, monkeypatch):
    from cadlib.data import lengths
    monkeypatch.setattr(lengths, "_read_jsonl_arrow", lambda path, column: None)
    p = tmp_path / "a.jsonl"
    p.write_text("".join(json.dumps({"n": int(n)}) + "\n" for n in LENS))
    assert np.array_equal(read_lengths(p), LENS)


def test_npy_integers_and_whole_floats(tmp_path):
    np.save(tmp_path / "a.npy", LENS.astype(np.int32))
    np.save(tmp_path / "b.npy", LENS.astype(np.float64))
    assert np.array_equal(read_lengths(tmp_path / "a.npy"), LENS)
    assert np.array_equal(read_lengths(tmp_path / "b.npy"), LENS)


def test_parquet_integer_and_list_columns(tmp_path):
    pa = _pyarrow()
    import pyarrow.parquet as pq
    ids = [list(range(int(n) % 50 + 1)) for n in LENS]
    pq.write_table(pa.table({"length": LENS, "input_ids": ids}), tmp_path / "a.parquet")
    assert np.array_equal(read_lengths(tmp_path / "a.parquet", "length"), LENS)
    assert np.array_equal(read_lengths(tmp_path / "a.parquet", "input_ids"), LENS % 50 + 1)


def test_datasets_save_to_disk_length_and_input_ids(tmp_path):
    datasets = pytest.importorskip("datasets", reason="saved datasets need the datasets package (data extra)")
    ids = [list(range(int(n) % 50 + 1)) for n in LENS]
    ds = datasets.Dataset.from_dict({"length": LENS.tolist(), "input_ids": ids})
    ds.save_to_disk(str(tmp_path / "ds"))
    assert length_format(tmp_path / "ds") == "datasets"
    assert np.array_equal(read_lengths(tmp_path / "ds", "length"), LENS)
    assert np.array_equal(read_lengths(tmp_path / "ds", "input_ids"), LENS % 50 + 1)
    datasets.DatasetDict({"train": ds.select_columns(["input_ids"])}).save_to_disk(str(tmp_path / "dd"))
    assert np.array_equal(read_lengths(tmp_path / "dd"), LENS % 50 + 1)


# ---------------------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, body, column, message", [
    ("e.txt", "", None, "holds no lengths"),
    ("e.txt", "# only a comment\n\n", None, "holds no lengths"),
    ("n.txt", "5\n7\nabc\n", None, "line 3 holds 'abc', not an integer"),
    ("f.txt", "5\n7.5\n", None, "line 2 holds '7.5', not an integer"),
    ("z.txt", "5\n\n0\n", None, "line 3 holds 0; give one integer length >= 1"),
    ("m.txt", "5\n-3\n", None, "line 2 holds -3"),
    ("t.txt", "5\n3 4\n", None, "line 2 holds more than one value"),
    ("c.csv", "a,b\n1,2\n", "len", "has no column 'len'; its columns are: a, b"),
    ("c.csv", "a,b\n1,2\n", None, "has 2 columns (a, b); name the one"),
    ("c.csv", "a,b\n1,x\n", "b", "row 2 holds 'x', not an integer"),
    ("c.csv", "a,b\n1,0\n", "b", "row 2 holds 0"),
    ("j.jsonl", '{"a": 1}\n{"b": 2}\n', "a", "line 2 has no column 'a'; its columns are: b"),
    ("j.jsonl", '{"a": 1}\n{"a": "x"}\n', "a", "line 2 holds 'x', not an integer"),
    ("j.jsonl", '{"a": 1}\n{"a": -1}\n', "a", "line 2 holds -1"),
    ("j.jsonl", '{"a": 1}\nnot json\n', "a", "line 2 is not JSON"),
    ("x.json", "[1]", None, "unknown suffix '.json'"),
])
def test_bad_text_files_are_named(tmp_path, name, body, column, message):
    p = tmp_path / name
    p.write_text(body)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        read_lengths(p, column)


def test_bad_binary_files_are_named(tmp_path):
    np.save(tmp_path / "z.npy", np.array([3, 0, 2]))
    with pytest.raises(ValueError, match=r"index 1 holds 0"):
        read_lengths(tmp_path / "z.npy")
    np.save(tmp_path / "f.npy", np.array([3.0, 2.5]))
    with pytest.raises(ValueError, match=r"index 1 holds .*2\.5.*not an integer"):
        read_lengths(tmp_path / "f.npy")
    np.save(tmp_path / "m.npy", np.ones((2, 2), dtype=int))
    with pytest.raises(ValueError, match=r"shape \(2, 2\); lengths must be one-dimensional"):
        read_lengths(tmp_path / "m.npy")
    np.save(tmp_path / "e.npy", np.zeros(0, dtype=int))
    with pytest.raises(ValueError, match="holds no lengths"):
        read_lengths(tmp_path / "e.npy")
    with pytest.raises(ValueError, match="column='x' applies to csv"):
        read_lengths(tmp_path / "z.npy", "x")
    with pytest.raises(ValueError, match="does not exist"):
        read_lengths(tmp_path / "nothing.txt")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ValueError, match="not a saved dataset"):
        read_lengths(tmp_path / "dir")


def test_bad_parquet_column_is_named(tmp_path):
    pa = _pyarrow()
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"n": [3, None, 2], "s": ["a", "b", "c"]}), tmp_path / "a.parquet")
    with pytest.raises(ValueError, match="column 'n' row 2 is empty"):
        read_lengths(tmp_path / "a.parquet", "n")
    with pytest.raises(ValueError, match="has no column 'len'; its columns are: n, s"):
        read_lengths(tmp_path / "a.parquet", "len")
    with pytest.raises(ValueError, match="row 1 holds 'a', not an integer"):
        read_lengths(tmp_path / "a.parquet", "s")


# ---------------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------------

def test_sample_lengths_fills_the_budget_with_the_last_document_clipped():
    for seed in range(5):
        docs = sample_lengths(LENS, 300_000, seed=seed, max_doc_len=100_000)
        assert sum(docs) == 300_000
        assert set(docs[:-1]) <= set(np.minimum(LENS, 100_000).tolist())
        assert 1 <= docs[-1] <= 100_000
    assert sample_lengths(LENS, 1000, seed=3) == sample_lengths(LENS, 1000, seed=3)


def test_empirical_draw_is_the_order_statistics_inverse_cdf():
    draw = empirical_draw([30, 10, 20, 40])
    u = np.array([0.0, 0.2499, 0.25, 0.5, 0.99999])
    assert draw(u).tolist() == [10, 10, 20, 30, 40]
    assert empirical_draw([10, 20], elongate=1.5)(np.array([0.1, 0.9])).tolist() == [15, 30]
    with pytest.raises(ValueError, match="integers >= 1"):
        empirical_draw([0, 3])


def test_a_file_drawn_from_a_table_gives_the_tables_batches_seed_for_seed():
    """The i-th document of both samplers sits at the same quantile level u_i. With n = 200,000 draws the
    empirical quantile's relative standard error is sqrt(u(1-u)/n) dlogQ/du: a few 0.01% in the
    table's body, 1.5-4% in its steep segments (pretrain's 1st-5th and 98th-99.5th percentiles); short
    documents differ besides by the rounding of the table's continuous quantile, a token."""
    big = np.array(sample_docs("pretrain", 2_000_000_000, seed=12345)[:200_000])
    for seed in (0, 100_003):
        a = np.array(sample_docs("pretrain", 8 * 65536, seed=seed))
        b = np.array(sample_lengths(big, 8 * 65536, seed=seed))
        n = min(a.size, b.size) - 1                        # before either clipped last document
        rel = np.maximum(np.abs(a[:n] - b[:n]) - 1, 0) / a[:n]
        assert n > 50 and np.median(rel) < 0.003 and np.quantile(rel, 0.95) < 0.03 and rel.max() < 0.1
