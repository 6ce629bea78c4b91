"""benchmarks/loader.py compares each tool at its best: the sweep's settings, the pick of the best and what is recorded.

The peers themselves are not run here (a run takes minutes); the bookkeeping that decides which
setting of each tool is compared is, on made-up figures.
"""

import json

from benchmarks import loader, results


def test_the_sweep_covers_worker_counts_then_compression_and_the_other_encoding_at_the_most_workers():
    lit = [loader.label(s) for s in loader.sweep("litdata", [1, 2, 4], ["none", "zstd"], [1])]
    assert lit == ["tensor none 1w", "tensor none 2w", "tensor none 4w", "tensor zstd 4w", "numpy none 4w"]
    mds = [loader.label(s) for s in loader.sweep("mosaic", [1, 2], ["none"], [1])]
    assert mds == ["ndarray none 1w", "ndarray none 2w", "bytes none 2w"]
    assert [loader.label(s) for s in loader.sweep("ours", [4], ["none"], [1, 2])] == ["1 read threads",
                                                                                     "2 read threads", "defaults"]
    ours = loader.sweep("ours", [4], ["none"], [2], processes=[2, 4])
    assert [loader.label(s) for s in ours] == ["2 read threads", "2 read processes", "4 read processes", "defaults"]
    assert ours[1] == {"read_processes": 2}  # the trainer's config key, passed to its BatchLoader as it is
    setting = {"encoding": "tensor", "compression": "zstd", "workers": 4}
    assert loader.dataset("litdata", setting) == "litdata-tensor-zstd"
    assert loader.dataset("ours", {"read_threads": 2}) == "."


def test_marginal_rates_drop_the_fixed_cost():
    small = {"samples": 256, "seconds": 5.0, "cpu": 3.0, "server_cpu": 0.0, "gets": 40}
    large = {"samples": 1024, "seconds": 6.0, "cpu": 4.536, "server_cpu": 0.768, "gets": 136}
    got = loader.marginal(small, large)
    assert got["rate"] == 768.0
    assert abs(got["cpu_ms"] - 2.0) < 1e-9 and abs(got["server_ms"] - 1.0) < 1e-9
    assert got["gets_k"] == 125.0  # 96 GETs for 768 more samples


def test_requests_are_counted_from_the_moto_log_object_gets_apart(tmp_path):
    log = tmp_path / "moto.log"
    assert loader.count_requests(str(log)) == (0, 0)  # no log yet
    log.write_text('127.0.0.1 - - [27/Nov 10:00] "\x1b[37mGET /bench-loader/n32/cache/x HTTP/1.1\x1b[0m" 206 -\n'
                   '127.0.0.1 - - [27/Nov 10:00] "GET /bench-loader?list-type=2&prefix=n32 HTTP/1.1" 200 -\n'
                   '127.0.0.1 - - [27/Nov 10:00] "HEAD /bench-loader/n32/plan/y HTTP/1.1" 200 -\n'
                   "a line that is no request\n")  # fmt: skip
    assert loader.count_requests(str(log)) == (1, 3)
    assert loader.ours_plan("full") == "plan" and loader.ours_plan("window:4096") == "plan-window-4096"


def test_the_best_setting_is_the_best_median_not_one_lucky_round():
    assert loader.best({"4w": [100.0, 110.0, 900.0], "2w": [200.0, 210.0, 190.0]}) == "2w"
    assert loader.best({"a": [5.0], "b": [5.0]}) == "a"


def test_every_round_records_each_tool_at_the_setting_best_over_all_rounds(tmp_path):
    settings = {"ours": [{"read_threads": 1}, {"read_threads": 2}],
                "litdata": loader.sweep("litdata", [1, 4], ["none"], [1])}
    rates = [  # per round: ours 1 thread, 2 threads; litdata tensor 1w, tensor 4w, numpy 4w
        (1000.0, 1200.0, 300.0, 800.0, 200.0),
        (1100.0, 1000.0, 900.0, 700.0, 250.0),  # a round where the other setting wins
        (1000.0, 1300.0, 310.0, 750.0, 240.0),
    ]
    rounds = []
    for k, (o1, o2, l1, l4, n4) in enumerate(rates):
        fig = {"ours": {"1 read threads": o1, "2 read threads": o2},
               "litdata": {"tensor none 1w": l1, "tensor none 4w": l4, "numpy none 4w": n4}}
        figures = {store: {t: {s: {"rate": r, "cpu_ms": 1.0, "server_ms": 0.5, "gets_k": 10.0}
                               for s, r in v.items()} for t, v in fig.items()} for store in ("local", "s3")}
        rounds.append({"load": {"load_before": 5.0 + k, "load_after": 6.0 + k}, "figures": figures})
    run = results.Run("loader", command="python benchmarks/loader.py")
    bests = loader.record(run, rounds, settings, ["local", "s3"])
    assert bests["local"] == {"ours": "2 read threads", "litdata": "tensor none 4w"} == bests["s3"]
    doc = json.loads(run.save(tmp_path).read_text())
    rows = {r["measure"]: r for r in doc["rows"]}
    ratio = rows["local: ours / litdata, samples/s"]
    assert ratio["rounds"] == [1200.0 / 800.0, 1000.0 / 700.0, 1300.0 / 750.0] and ratio["met"] is True
    assert ratio["note"] == "each at its best"
    best = rows["local: litdata samples/s"]
    assert best["median"] == 750.0 and best["note"] == "tensor none 4w"
    assert rows["s3: ours reader + moto server CPU-ms/sample"]["median"] == 1.5  # reader 1.0 + server 0.5
    assert rows["local: ours CPU-ms/sample"]["median"] == 1.5 and "local: ours GETs per 1,000 samples" not in rows
    assert rows["s3: litdata GETs per 1,000 samples"]["median"] == 10.0
    assert rows["s3: ours CPU-ms/sample (reader + server) / the best peer's"]["median"] == 1.0
    assert rows["local sweep: litdata numpy none 4w"]["rounds"] == [200.0, 250.0, 240.0]
    assert doc["rounds"][1] == {"load_before": 6.0, "load_after": 7.0}  # the load of the measurement, not of now


def test_warm_reads_exactly_the_files_of_the_pass(tmp_path):
    """Before a local pass its own files are read (ours: the cache and the plan of the size's folder, not the
    peers' datasets beside them; a peer: its dataset folder), so its clock times reads from the page cache."""
    size = tmp_path / "n1024"
    sizes = {"cache/shards/a.bin": 3000, "cache/_cache.json": 10, "plan/p.json": 7, "litdata-tensor-none/0.bin": 500,
             "mosaic-ndarray-none/shard.mds": 900}  # fmt: skip
    for name, n in sizes.items():
        (size / name).parent.mkdir(parents=True, exist_ok=True)
        (size / name).write_bytes(b"x" * n)
    assert loader.warm("ours", str(size)) == 3000 + 10 + 7
    assert loader.warm("litdata", str(size / "litdata-tensor-none")) == 500
    assert loader.warm("mosaic", str(size / "mosaic-ndarray-none")) == 900


def test_of_repeated_passes_the_fastest_counts_with_its_own_cpu_and_requests():
    slow = {"samples": 1024, "seconds": 4.0, "cpu": 5.0, "server_cpu": 0.5, "gets": 40}
    quick = {"samples": 1024, "seconds": 3.0, "cpu": 4.5, "server_cpu": 0.4, "gets": 38}
    assert loader.fastest([slow, quick]) is quick and loader.fastest([quick, slow]) is quick
    assert loader.fastest([slow]) is slow
