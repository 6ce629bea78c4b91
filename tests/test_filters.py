"""The one filter language (manifests/filters.py) of --where, --weight-by, --shot-where and the review page:
random valid filters keep the rows polars' SQL kept, SQL's NULL rules hold, and text that would read a file,
reach the network or run a subquery is refused before anything is evaluated, through every command and against
a running review server (a listener on 127.0.0.1 counts the connections it would have made)."""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import time
import urllib.parse

import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manifests.errors import UsageError
from manifests.filters import MAX_DEPTH, MAX_LENGTH, MAX_NODES, MAX_TEXT_OPS, parse_filter
from manifests.select import where_mask
from tests.test_report import scored  # noqa: F401  (a module fixture)
from tests.test_review import _get

EXAMPLES = int(os.environ.get("FILTER_EXAMPLES", 300))  # random filters per property (FILTER_EXAMPLES=5000: longer)
SECRET = "root:SECRET-LINE-of-a-file-no-filter-may-read"


def _frame(rows: int = 96, seed: int = 0) -> pl.DataFrame:
    rng = np.random.default_rng(seed)

    def nulled(values: list) -> list:
        return [None if rng.random() < 0.15 else v for v in values]

    return pl.DataFrame({
        "i": pl.Series(nulled(rng.integers(-20, 20, rows).tolist()), dtype=pl.Int64),
        "j": pl.Series(nulled(rng.integers(-5, 5, rows).tolist()), dtype=pl.Int32),
        "x": pl.Series(nulled(np.round(rng.normal(0, 3, rows), 2).tolist()), dtype=pl.Float64),
        "b": pl.Series(nulled(rng.random(rows) < 0.5), dtype=pl.Boolean),
        "s": pl.Series(nulled(["".join(rng.choice(list("aAbB_% "), rng.integers(0, 5))) for _ in range(rows)]),
                       dtype=pl.String),
    })  # fmt: skip


FRAME = _frame()


# -- random valid filters, as text, fully parenthesised: the same rows and values as polars' SQL gave ----------------

def _num(depth: int) -> st.SearchStrategy[str]:
    # LENGTH is signed here, unsigned in polars' SQL (where LENGTH(s) - 5 wraps): compared through a cast
    leaf = st.sampled_from(["i", "j", "x", "3", "(-2)", "0", "0.5", "(-1.25)", "CAST(LENGTH(s) AS BIGINT)"])
    if depth == 0:
        return leaf
    sub, cond, text = _num(depth - 1), _bool(depth - 1), _str(depth - 1)
    return st.one_of(
        leaf,
        st.tuples(sub, st.sampled_from(["+", "-", "*"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(st.sampled_from(["ABS", "COALESCE", "GREATEST", "LEAST"]), sub, sub).map(
            lambda t: f"{t[0]}({t[1]})" if t[0] == "ABS" else f"{t[0]}({t[1]}, {t[2]})"),
        st.tuples(cond, sub, sub).map(lambda t: f"(CASE WHEN {t[0]} THEN {t[1]} ELSE {t[2]} END)"),
        text.map(lambda s: f"CAST(LENGTH({s}) AS BIGINT)"),
    )


def _str(depth: int) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(["s", "'ab'", "'B'", "''"])
    if depth == 0:
        return leaf
    sub = _str(depth - 1)
    return st.one_of(leaf, st.tuples(st.sampled_from(["LOWER", "UPPER"]), sub).map(lambda t: f"{t[0]}({t[1]})"),
                     st.tuples(sub, sub).map(lambda t: f"({t[0]} || {t[1]})"),
                     st.tuples(sub, sub).map(lambda t: f"COALESCE({t[0]}, {t[1]})"))  # fmt: skip


def _bool(depth: int) -> st.SearchStrategy[str]:
    leaf = st.sampled_from(["b", "TRUE", "FALSE", "(i > 0)", "(s = 'a')", "(x IS NULL)"])
    if depth == 0:
        return leaf
    num, text, sub = _num(depth - 1), _str(depth - 1), _bool(depth - 1)
    compare = st.sampled_from(["=", "<>", "!=", "<", "<=", ">", ">="])
    pattern = st.text("aAb%_", min_size=0, max_size=4).map(lambda p: f"'{p}'")
    return st.one_of(
        leaf,
        st.tuples(num, compare, num).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(text, compare, text).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(sub, st.sampled_from(["AND", "OR"]), sub).map(lambda t: f"({t[0]} {t[1]} {t[2]})"),
        sub.map(lambda t: f"(NOT {t})"),
        st.tuples(num, st.sampled_from(["", "NOT "]), num, num).map(
            lambda t: f"({t[0]} {t[1]}BETWEEN {t[2]} AND {t[3]})"),
        st.tuples(num, st.sampled_from(["", "NOT "]), st.lists(st.integers(-3, 3), min_size=1, max_size=4)).map(
            lambda t: f"({t[0]} {t[1]}IN ({', '.join(map(str, t[2]))}))"),
        st.tuples(text, st.sampled_from(["", "NOT "]), st.lists(st.sampled_from(["a", "B", "ab"]), min_size=1,
                                                                max_size=3)).map(  # fmt: skip
            lambda t: f"({t[0]} {t[1]}IN ({', '.join(repr(v) for v in t[2])}))"),
        st.tuples(st.one_of(num, text, sub), st.sampled_from(["IS NULL", "IS NOT NULL"])).map(
            lambda t: f"({t[0]} {t[1]})"),
        st.tuples(text, st.sampled_from(["LIKE", "NOT LIKE", "ILIKE", "NOT ILIKE"]), pattern).map(
            lambda t: f"({t[0]} {t[1]} {t[2]})"),
        st.tuples(sub, sub).map(lambda t: f"COALESCE({t[0]}, {t[1]})"),
    )


def _sql(text: str) -> pl.Series:
    return FRAME.select(pl.sql_expr(text).alias("_value")).to_series()


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")  # the strategies' long repr
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bool(3))
def test_random_filters_keep_the_rows_polars_sql_kept(text):
    try:
        want = _sql(text)
    except BaseException:  # polars' SQL refuses it or panics (old polars): ours evaluates it or says so in one line
        with contextlib.suppress(UsageError):
            parse_filter(text).mask(FRAME)
        return
    want = want.cast(pl.Boolean).fill_null(False).to_numpy().astype(bool)
    if len(want) == 1:
        want = np.repeat(want, FRAME.height)
    assert parse_filter(text).mask(FRAME).tolist() == want.tolist(), text


@pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_num(3))
def test_random_weights_have_the_values_polars_sql_gave(text):
    try:
        want = _sql(text).cast(pl.Float64).to_numpy().astype(np.float64)
    except BaseException:  # as above
        with contextlib.suppress(UsageError):
            parse_filter(text, "--weight-by").values(FRAME)
        return
    got = parse_filter(text, "--weight-by").values(FRAME).cast(pl.Float64).to_numpy().astype(np.float64)
    np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=1e-12, equal_nan=True, err_msg=text)


@pytest.mark.parametrize("text", [
    "NOT i = 1", "i = 1 OR j = 2 AND b", "i + j * 2 > 3", "-i::float < x", "i BETWEEN 1 AND 5 AND b",
    "x IS NULL = FALSE", "NOT b IS NULL", "i = j IS NULL", "s || 'x' = 'ax'", "1 < 2 < 3",
    "i > -3 AND NOT b OR s LIKE 'a%'",
    "CASE WHEN i > 0 THEN 1 WHEN i < 0 THEN -1 ELSE 0 END = 1", "CASE j WHEN 1 THEN TRUE ELSE b END",
    "CAST(i AS DOUBLE) / 4 > 0.5", "TRY_CAST(s AS INT) IS NULL", "i IN (1, -2, 3)", "s NOT IN ('a', 'B')",
    "i IS DISTINCT FROM j", "i IS NOT DISTINCT FROM j", "\"i\" + 1 > 0", "ROUND(x, 1) > 0.5", "x / i > 1",
])  # fmt: skip
def test_precedence_and_forms_read_as_polars_sql_read_them(text):
    want = _sql(text).cast(pl.Boolean).fill_null(False).to_numpy().astype(bool)
    assert parse_filter(text).mask(FRAME).tolist() == np.broadcast_to(want, (FRAME.height,)).tolist()


def test_sql_null_rules_remainder_sign_and_64_bit_arithmetic_are_the_documented_ones():
    frame = pl.DataFrame({"d": [True, False, None], "a": [-7, 7, None], "c": ["a\ncat", "cat", None]})

    def kept(text: str) -> list[int]:
        return np.flatnonzero(parse_filter(text).mask(frame)).tolist()

    # IS [NOT] TRUE / FALSE are never NULL: a sample with no annotations row is kept by `duplicate IS NOT TRUE`
    # (as docs/annotate.md says; polars 2's SQL gave NULL there and dropped it)
    assert kept("d IS NOT TRUE") == [1, 2] and kept("d IS TRUE") == [0] and kept("d IS NOT FALSE") == [0, 2]
    assert kept("NOT d") == [1] and kept("d = NULL") == [] and kept("d IS NULL") == [2]
    assert kept("a IN (7, NULL)") == [1] and kept("NOT (a IN (7, NULL))") == []  # NULL in the list: never FALSE
    # SQL's remainder has the dividend's sign (polars' % has the divisor's)
    values = parse_filter("a % 2", "--weight-by").values(frame).to_list()
    assert values == [-1, 1, None] and parse_filter("MOD(a, -2)").values(frame).to_list() == [-1, 1, None]
    # LIKE's % crosses newlines; ILIKE ignores case; a pattern's regex characters are literal
    assert kept("c LIKE '%cat'") == [0, 1] and kept("c ILIKE 'A%'") == [0] and kept("c LIKE 'c.t'") == []
    assert kept("c LIKE 'c_t'") == [1]
    # integer arithmetic in 64 bits (polars' SQL wrapped int32 width * height past 2**31), LENGTH signed
    sizes = pl.DataFrame({"width": pl.Series([60000, 1000], dtype=pl.Int32), "height": pl.Series([60000, 1000],
                          dtype=pl.Int32), "n": pl.Series([3, 1], dtype=pl.UInt8), "c": ["ab", "abcdefg"]})  # fmt: skip
    assert parse_filter("width * height").values(sizes).to_list() == [3_600_000_000, 1_000_000]
    assert parse_filter("width * height >= 1000000").mask(sizes).tolist() == [True, True]
    assert parse_filter("n - 5").values(sizes).to_list() == [-2, -4]
    assert parse_filter("LENGTH(c) - 5").values(sizes).to_list() == [-3, 2]


# -- refused: every reading function and subquery form, bounds, and one line naming the construct ------------------

READS = [
    "width IN (SELECT nope FROM read_csv('{0}'))",
    "width IN (SELECT * FROM read_parquet('{0}'))",
    "EXISTS (SELECT 1 FROM read_json('{0}'))",
    "width = (SELECT max(width) FROM read_ipc('{0}'))",
    "width IN (SELECT * FROM read_ndjson('{0}'))",
    "width IN (SELECT * FROM read_delta('{0}'))",
    "width IN (SELECT * FROM '{0}')",
    "read_csv('{0}') IS NULL",
    "width > ANY (SELECT width FROM read_csv('{0}'))",
    "width IN (WITH t AS (SELECT * FROM read_csv('{0}')) SELECT * FROM t)",
    "width IN (SELECT 1 UNION SELECT * FROM read_csv('{0}'))",
    "width IN (VALUES (1)) OR caption IN (SELECT column_1 FROM read_csv('{0}'))",
]


@pytest.mark.parametrize("form", READS)
def test_reading_functions_and_subqueries_are_refused_before_anything_is_read(form, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text(SECRET + "\n")
    for target in (str(secret), "http://127.0.0.1:9/x.csv", "s3://bucket/x.csv"):
        with pytest.raises(UsageError) as e:
            parse_filter(form.format(target))
        message = str(e.value)
        assert len(message.splitlines()) == 1 and "not allowed in a filter" in message, message
        assert "SECRET" not in message and "valid columns" not in message


@pytest.mark.parametrize("text, construct", [
    ("lpad(filename, 1000000) <> ''", "function lpad() is not allowed"),
    ("repeat(caption, 100000) <> ''", "function repeat() is not allowed"),
    ("width; DROP TABLE x", "';' is not part of a filter"),
    ("width > 1 -- and the rest", "comments"),
    ("width > $1", "'$' is not part of a filter"),
    ("\"*\" IS NULL", "'*' is not a column name"),
    ("\"^.*$\" IS NULL", "is not a column name"),
    ("DATE '2020-01-01' IS NULL", "a DATE literal (DATE) is not allowed"),
    ("caption SIMILAR TO 'a'", "SIMILAR TO"),
    ("caption LIKE filename", "LIKE takes a text literal pattern"),
    ("width IN (height)", "IN takes a list of literal values"),
    ("CAST(width AS BLOB) IS NULL", "'BLOB' is not a type"),
    ("round(width, height) > 1", "round()'s second argument"),
    ("width > 99999999999999999999", "too large (at most 18446744073709551615)"),
    ("'unclosed", "not closed"),
    ("width >", "it ends where a value is expected"),
    ("", "is empty"),
])  # fmt: skip
def test_outside_the_language_is_one_line_naming_the_construct(text, construct):
    with pytest.raises(UsageError) as e:
        parse_filter(text, "--where")
    assert construct in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


def test_size_depth_and_text_work_are_bounded():
    for text, words in (("width > 1 AND " * (MAX_LENGTH // 14 + 1) + "TRUE", f"at most {MAX_LENGTH}"),
                        (" OR ".join(["width > 1"] * (MAX_NODES // 3 + 1)), f"more than {MAX_NODES} terms"),
                        ("(" * (MAX_DEPTH + 1) + "width" + ")" * (MAX_DEPTH + 1) + " > 1", "nested more than"),
                        (" OR ".join(["lower(caption) = 'a'"] * (MAX_TEXT_OPS + 1)), "operations on text"),
                        ("caption = '" + "a" * 1001 + "'", "a text literal of 1001 characters")):  # fmt: skip
        started = time.perf_counter()
        with pytest.raises(UsageError, match=words):
            parse_filter(text)
        assert time.perf_counter() - started < 1.0
    # at the bounds it parses: the largest filters a user writes are far inside them
    parse_filter(" OR ".join(["lower(caption) = 'a'"] * MAX_TEXT_OPS))
    parse_filter("(" * (MAX_DEPTH - 3) + "width" + ")" * (MAX_DEPTH - 3) + " > 1")


def test_the_same_parser_serves_shot_where_and_the_filter_reads_only_its_columns():
    frame = pl.DataFrame({"start": [0, 40], "frames": [40, 9], "motion": [0.7, None]})
    assert where_mask(frame, "motion > 0.5 AND frames >= 33", "--shot-where").tolist() == [True, False]
    with pytest.raises(UsageError, match=r"^--shot-where .*: a subquery \(SELECT\) is not allowed"):
        where_mask(frame, "frames IN (SELECT 1)", "--shot-where")
    with pytest.raises(UsageError, match="'beauty', which no column is; the columns are start, frames, motion"):
        where_mask(frame, "beauty > 1", "--shot-where")
    assert parse_filter("COALESCE(a, b) > \"c d\" OR lower(e) LIKE '%x%'").columns == ("a", "b", "c d", "e")


def test_plan_stats_and_report_refuse_a_subquery_in_the_same_one_line(scored, tmp_path, capsys):  # noqa: F811
    from pipeline.cli import main

    where = f"width IN (SELECT * FROM read_csv('{tmp_path / 'x.csv'}'))"
    commands = (["plan", scored.manifest, "--out", str(tmp_path / "p"), "--world-size", "1", "--batch-size", "1"],
                ["stats", scored.manifest], ["report", scored.manifest, "--out", str(tmp_path / "r.html")])
    for command in commands:
        capsys.readouterr()
        assert main([*command, "--annotations", scored.scores, "--where", where]) == 2, command
        err = capsys.readouterr().err.strip()
        assert err.endswith("a subquery (SELECT) is not allowed in a filter") and len(err.splitlines()) == 1, err


# -- against a running review server: nothing read, nothing fetched, nothing hangs, memory flat -----------------------

@pytest.fixture(scope="module")
def page(scored, tmp_path_factory):  # noqa: F811
    from pipeline.review.job import ReviewJob, session

    job = ReviewJob(manifest=scored.manifest, out=str(tmp_path_factory.mktemp("filters") / "decisions"), port=0,
                    annotations=(scored.scores, scored.dedup))  # fmt: skip
    with session(job) as (url, _):
        parts = urllib.parse.urlsplit(url)
        yield f"{parts.scheme}://{parts.netloc}", urllib.parse.parse_qs(parts.query)["token"][0]


def _view(page: tuple[str, str], where: str) -> tuple[int, str]:
    base, token = page
    started = time.perf_counter()
    status, body = _get(f"{base}/api/view?" + urllib.parse.urlencode({"where": where}),
                        {"X-Bucketeer-Token": token})  # fmt: skip
    assert time.perf_counter() - started < 5, where
    return status, body.decode()


def test_the_page_reads_no_file_fetches_no_url_and_never_hangs(page, tmp_path):
    secret = tmp_path / "shadow"
    secret.write_text(SECRET + "\n")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    try:
        for form in READS:
            for target in (str(secret), f"http://127.0.0.1:{port}/x.csv", str(fifo)):
                status, body = _view(page, form.format(target))
                assert status == 400 and "not allowed in a filter" in body, (form, target, body)
                assert "SECRET" not in body and "valid columns" not in body
        readable, _, _ = select.select([listener], [], [], 0.5)
        assert not readable, "the server connected to the listener"
    finally:
        listener.close()
    assert _view(page, "aesthetic > 5 AND NOT duplicate")[0] == 200  # a filter of the language still works


def test_the_padding_filter_is_refused_in_under_a_second_with_memory_flat(page):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, the server runs in this process
    started = time.perf_counter()
    status, body = _view(page, "length(lpad(filename, 100000000)) > 0")  # 100 MB a row
    assert time.perf_counter() - started < 1.0
    assert status == 400 and "function lpad() is not allowed" in body, body
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 50 * 1024


def test_a_long_in_list_is_one_lookup_with_the_rows_of_the_equalities():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 2**63, 200, dtype=np.uint64) * np.uint64(2) + np.uint64(1)  # above int64, as ids are
    frame = pl.DataFrame({"sample_id": pl.Series(ids, dtype=pl.UInt64).scatter([5, 6], None),
                          "n": pl.Series(rng.integers(-50, 50, 200), dtype=pl.Int16),
                          "bucket": pl.Series([f"{w}x1024" for w in rng.integers(0, 40, 200) * 64])})  # fmt: skip
    for text, lookup in ((f"sample_id IN ({', '.join(str(int(i)) for i in ids[:30])})", False),  # > int64: equalities
                         (f"sample_id IN ({', '.join(str(int(i) // 4) for i in ids[:30])})", True),
                         ("sample_id IN (1, 2)", False),  # short: the equalities
                         ("n IN (" + ", ".join(map(str, range(-60, 60, 7))) + ", 100000)", True),  # beyond Int16
                         ("n NOT IN (" + ", ".join(map(str, range(-60, 60, 7))) + ")", True),
                         ("bucket IN (" + ", ".join(f"'{w * 64}x1024'" for w in range(0, 40, 3)) + ")", True),
                         ("n IN (1, 2, 3, 4, 5, 6, 7, 8, 9.5)", False)):  # fmt: skip
        parsed = parse_filter(text)
        assert ("is_in" in str(parsed.expr(frame.schema))) == lookup, text
        want = frame.select(parsed.expr().alias("v")).to_series()  # no schema: always the equalities
        assert parsed.values(frame).to_list() == want.to_list(), text
    kept = parse_filter(f"sample_id IN ({', '.join(str(int(i)) for i in ids[:30])})").mask(frame)
    assert kept.tolist() == [i < 30 and i not in (5, 6) for i in range(200)]
