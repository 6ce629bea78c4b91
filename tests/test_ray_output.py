"""What Ray may print on a user's screen (:mod:`pipeline.ray_output`): the false alarm Ray core prints for every
Ray Data actor pool is dropped, everything else passes byte for byte, in order; and a real Ray Data actor pool run
through :func:`pipeline.embed.dataflow.results` (what embed and annotate read) leaves no ``core_worker`` line."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from pipeline.ray_output import drop_false_alarms, ray_false_alarms_dropped
from tests.test_readme import ROOT

ALARM = (b"[2026-11-27 02:09:46,390 E 19662 19662] core_worker.cc:2465: Actor with class name: "
         b"'MapWorker(MapBatches(TextWriter))' and ID: 'a9567e65e4d22c5c8a66f59501000000' has constructor arguments "
         b"in the object store and max_restarts > 0. If the arguments in the object store go out of scope or are "
         b"lost, the actor restart will fail. See https://github.com/ray-project/ray/issues/53727 for more details.\n")
REAL_ERROR = b"[2026-11-27 02:09:47,001 E 19662 19662] core_worker.cc:1200: Failed to register actor. Error: boom\n"


def test_only_the_false_alarm_is_dropped():
    chunk = b"embed images: 12/300\r" + ALARM + REAL_ERROR + b"Traceback (most recent call last):\n"
    kept, dropped = drop_false_alarms(chunk)
    assert dropped == 1
    assert kept == b"embed images: 12/300\r" + REAL_ERROR + b"Traceback (most recent call last):\n"
    # another actor's line, and the same words about another class, are not the false alarm
    other = ALARM.replace(b"MapWorker(MapBatches(TextWriter))", b"MyActor")
    assert drop_false_alarms(other) == (other, 0)


def test_stderr_passes_through_without_the_alarm_in_order(capfd):
    with ray_false_alarms_dropped():
        os.write(2, b"first\n")
        os.write(2, ALARM)
        print("python stderr", file=sys.__stderr__, flush=True)  # fd 2, as a user's sys.stderr is
        os.write(2, REAL_ERROR)
        os.write(2, b"a progress line without its newline\r")
    os.write(2, b"after\n")
    err = capfd.readouterr().err
    assert err == ("first\npython stderr\n" + REAL_ERROR.decode() + "a progress line without its newline\rafter\n")


def test_stderr_is_restored_after_an_error(capfd):
    with pytest.raises(RuntimeError), ray_false_alarms_dropped():
        os.write(2, b"before the error\n")
        raise RuntimeError("a worker's error")
    os.write(2, ALARM)  # outside the block nothing is filtered
    err = capfd.readouterr().err
    assert err == "before the error\n" + ALARM.decode()


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.full
def test_a_real_ray_data_actor_pool_prints_no_core_worker_line(tmp_path, bucketeer_home):
    # a fresh process: Ray core prints the line once per process, so a process that made an actor pool before
    # would pass for the wrong reason. The debug line proves Ray did print it, into the filter.
    script = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(name)s: %(message)s")
        from pipeline.ray_setup import init_ray
        ray, _ = init_ray(local=True)
        import ray.data
        from pipeline.embed.dataflow import configure_ray_data, results

        class Echo:
            def __call__(self, batch):
                return batch

        configure_ray_data()
        pool = ray.data.range(6, override_num_blocks=3).map_batches(Echo, compute=ray.data.ActorPoolStrategy(size=1))
        print("rows", len(list(results(pool))))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BUCKETEER_HOME": bucketeer_home}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rows 6" in done.stdout
    assert "dropped 1 line(s) of Ray's that are false alarms" in done.stdout, done.stdout[-2000:]
    assert "core_worker" not in done.stderr, done.stderr
