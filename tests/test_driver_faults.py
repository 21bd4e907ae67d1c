"""The driver side when the cluster misbehaves: a hung worker, a scheduler that is gone for
longer than the client waits, clusters started one after another in one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import errors, slurm
from plexrl_dask.cluster import scheduler_process
from tests.conftest import unique


def test_a_hung_worker_does_not_hang_the_diagnosis_of_workers_without_holders(
    tmp_path, monkeypatch
):
    """``wait_for_plexrl_workers`` asks the workers that joined without a replica holder
    for their plugins; one stopped (SIGSTOP, as a hung node) made that ask wait forever.
    Now it is bounded and says so in the typed error."""
    monkeypatch.setattr(slurm, "COMMAND_TIMEOUT_S", 2.0)
    dask_cli = str(Path(sys.executable).parent / "dask")
    with scheduler_process(tmp_path) as info:
        worker = subprocess.Popen(
            [dask_cli, "worker", info["address"], "--host", "127.0.0.1", "--nthreads", "1",
             "--no-dashboard", "--no-nanny"],  # (no GPU resource: it gets no holder)
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            with Client(info["address"], timeout=30) as client:
                client.wait_for_workers(1, timeout=60)
                os.kill(worker.pid, signal.SIGSTOP)
                with pytest.raises(errors.WorkersNotStarted, match="not all answered"):
                    slurm.wait_for_plexrl_workers(client, 1, timeout=1.0)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
            worker.kill()
            worker.wait()


def test_waiting_for_a_scheduler_keeps_its_timeout_and_a_client_that_gave_up_is_typed(tmp_path):
    """``wait_for_scheduler(timeout)`` gives up at its timeout (each try was bounded by the
    request timeout instead); once the client gives up reconnecting and closes itself (past
    its own ``timeout``), every call is :class:`SchedulerLost` saying so (it was an
    ``AttributeError`` of the closed client)."""
    with scheduler_process(tmp_path) as info:
        client = Client(info["address"], timeout=3)
        runtime = plexrl.Runtime(client, job=unique("w"))
        assert runtime.status()["status"] == "OK"
    try:  # (the scheduler process has ended)
        t0 = time.monotonic()
        with pytest.raises(errors.SchedulerLost):
            runtime.wait_for_scheduler(timeout=1.0)
        assert time.monotonic() - t0 < 1.0 + 10.0  # (not the request timeout, 300 s)
        for _ in range(120):  # (the client's reconnection ends after its 3 s timeout)
            if client.status == "closed":
                break
            time.sleep(0.25)
        with pytest.raises(errors.SchedulerLost, match="gave up reconnecting"):
            runtime.status()
        with pytest.raises(errors.SchedulerLost, match="gave up reconnecting"):
            runtime.wait_for_scheduler(timeout=30.0)
    finally:
        client.close()


def test_local_clusters_one_after_another_leave_no_loop_thread_behind():
    """The scheduler plugin's own asynchronous client counted itself on the cluster's loop
    runner and never uncounted: each closed ``local_cluster`` left its loop thread, and the
    scheduler on it, running in the process."""

    def loops() -> int:
        return sum(t.name == "IO loop" for t in threading.enumerate())

    after = []
    for _ in range(2):
        with plexrl.local_cluster(n_workers=1) as cluster, Client(cluster) as client:
            plexrl.Runtime(client, job=unique("j")).status()
        after.append(loops())
    assert after[1] == after[0], after
