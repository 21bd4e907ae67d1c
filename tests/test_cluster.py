"""``local_cluster``'s workers on a node with several GPUs: one GPU each, by worker name.

No GPU exists here: the node's GPU list is given (``visible_gpus`` is what the nannies ask),
and the real worker processes show the ``CUDA_VISIBLE_DEVICES`` they were started with."""

from __future__ import annotations

import os

import dask
import pytest
import torch
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import cluster
from plexrl_dask.errors import ConfigError, SchedulerNotStarted
from plexrl_dask.tools import PythonSandbox, ToolCall, ToolPool
from plexrl_dask.tools.pool import tool_workers


def _cuda_env() -> str | None:
    return os.environ.get("CUDA_VISIBLE_DEVICES")  # in the worker's process


def test_the_gpus_a_node_offers_follow_its_own_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 7")
    if not torch.cuda.is_available():
        assert cluster.visible_gpus() == []  # workers run on the CPU whatever it says
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cluster.visible_gpus() == ["2", "7"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert cluster.visible_gpus() == []  # CUDA's own meaning: no GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with dask.config.set({"plexrl.worker.device": "cpu"}):
        assert cluster.visible_gpus() == []  # CPU workers get no GPU


def test_each_local_worker_sees_one_gpu_of_the_node(monkeypatch):
    monkeypatch.setattr(cluster, "visible_gpus", lambda: ["3", "5"])
    with (
        plexrl.local_cluster(n_workers=2) as c,
        Client(c, set_as_default=False) as client,
    ):
        seen = client.run(_cuda_env)
        names = {w["id"]: a for a, w in plexrl.worker_info(client).items()}
        assert (seen[names[0]], seen[names[1]]) == ("3", "5")


def test_one_gpu_or_an_explicit_choice_is_left_alone(monkeypatch):
    monkeypatch.setattr(cluster, "visible_gpus", lambda: ["0"])
    with (
        plexrl.local_cluster(n_workers=1) as c,
        Client(c, set_as_default=False) as client,
    ):
        seen = client.run(_cuda_env)
        assert list(seen.values()) == [os.environ.get("CUDA_VISIBLE_DEVICES")]
    monkeypatch.setattr(cluster, "visible_gpus", lambda: ["3", "5"])
    with (
        plexrl.local_cluster(n_workers=1, env={"CUDA_VISIBLE_DEVICES": "9"}) as c,
        Client(c, set_as_default=False) as client,
    ):
        assert list(client.run(_cuda_env).values()) == ["9"]  # the caller's choice stands


def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))  # (run on a worker: its threads' cores)


def test_cpus_of_worker_gives_each_worker_its_threads_cores_from_the_last():
    cpus = [0, 1, 2, 3, 8, 9, 10]
    assert [cluster.cpus_of_worker(k, 2, cpus, 1) for k in (0, 1)] == [[10], [9]]
    assert [cluster.cpus_of_worker(f"pod-{k}", 3, cpus, 2) for k in (0, 1, 2)] == [
        [9, 10],
        [3, 8],
        [1, 2],
    ]
    assert cluster.cpus_of_worker(0, 1, [0, 1], 1) == [1]  # the driver keeps a core
    assert cluster.cpus_of_worker(0, 2, [0, 1], 1) is None  # no core left to the rest
    assert cluster.cpus_of_worker(0, 3, [0, 1], 1) is None
    assert cluster.cpus_of_worker(2, 2, cpus, 1) is None  # past the count (a later scale-up)
    assert cluster.cpus_of_worker("tool-a", 2, cpus, 1) is None
    assert cluster.cpus_of_worker(True, 2, cpus, 1) is None
    assert cluster.cpus_of_worker(0, 2, cpus, 0) is None


def test_parse_cpus_reads_taskset_lists_and_refuses_the_rest():
    assert cluster.parse_cpus("3") == [3]
    assert cluster.parse_cpus("0-2, 8,2") == [0, 1, 2, 8]
    for bad in ("", "a", "3-1", "-1", "1,,2", "0-"):
        with pytest.raises(ConfigError, match="PLEXRL_WORKER_CPUS"):
            cluster.parse_cpus(bad)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two cores here")
def test_local_workers_run_on_cores_of_their_own_and_the_setting_turns_it_off():
    cores = sorted(os.sched_getaffinity(0))
    with (
        plexrl.local_cluster(n_workers=1) as c,
        Client(c, set_as_default=False) as client,
    ):
        assert list(client.run(_cores).values()) == [[cores[-1]]]
        assert sorted(os.sched_getaffinity(0)) == cores  # the driver is left alone
    if len(cores) <= 4:  # (a worker per core)
        with (
            plexrl.local_cluster(n_workers=len(cores)) as c,
            Client(c, set_as_default=False) as client,
        ):
            assert list(client.run(_cores).values()) == [cores] * len(cores)  # none to spare
    with (
        dask.config.set({"plexrl.local-cluster.bind-cpus": False}),
        plexrl.local_cluster(n_workers=1) as c,
        Client(c, set_as_default=False) as client,
    ):
        assert list(client.run(_cores).values()) == [cores]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two cores here")
def test_tool_workers_and_their_sandboxes_run_on_the_cores_given_them():
    """``plexrl.local-cluster.tool-cpus`` binds the tool workers, and the programs they
    sandbox inherit it; a list that does not parse or is not this machine's is a typed error
    before any worker starts."""
    cores = sorted(os.sched_getaffinity(0))
    with (
        dask.config.set({"plexrl.local-cluster.tool-cpus": str(cores[0])}),
        plexrl.local_cluster(n_workers=1, tool_workers=1) as c,
        Client(c, set_as_default=False) as client,
    ):
        tools = set(tool_workers(client))
        seen = client.run(_cores)
        assert [seen[t] for t in tools] == [[cores[0]]]
        assert [v for w, v in seen.items() if w not in tools] == [[cores[-1]]]
        program = "import os\nprint(sorted(os.sched_getaffinity(0)))"
        [result] = ToolPool(client, {"py": PythonSandbox()}).run([ToolCall("py", program)], 10.0)
        assert result.output == f"[{cores[0]}]\n"
    for bad in ("banana", "4096"):
        with (
            dask.config.set({"plexrl.local-cluster.tool-cpus": bad}),
            pytest.raises(ConfigError, match="tool-cpus"),
        ):
            plexrl.local_cluster(n_workers=1, tool_workers=1)


def test_a_bad_core_list_leaves_the_worker_unbound_and_serving():
    cores = sorted(os.sched_getaffinity(0))
    for listed in ("banana", "4096"):  # (does not parse; not this machine's)
        with (
            plexrl.local_cluster(n_workers=1, env={cluster.CPUS_ENV: listed}) as c,
            Client(c, set_as_default=False) as client,
        ):
            assert list(client.run(_cores).values()) == [cores]
            runtime = plexrl.Runtime(client, job="bad-cpus")
            policy = runtime.deploy("policy", plexrl.ModelSpec.tiny(hidden_size=32))
            assert plexrl.result(policy.sample([[5, 6]], plexrl.SamplingParams(max_tokens=2)))


def test_a_scheduler_process_that_does_not_serve_in_time_is_a_typed_error(tmp_path):
    with (
        pytest.raises(SchedulerNotStarted, match="did not start within 0.0s"),
        cluster.scheduler_process(tmp_path, timeout=0.0),
    ):
        pass


def test_gpu_of_worker_follows_the_number_in_a_workers_name():
    gpus = ["3", "5"]
    assert [cluster.gpu_of_worker(n, gpus) for n in (0, 1, 2)] == ["3", "5", "3"]
    assert [cluster.gpu_of_worker(f"pod-a-{k}", gpus) for k in (0, 1)] == ["3", "5"]
    assert cluster.gpu_of_worker("pod-a", gpus) is None  # no number: all of them
    assert cluster.gpu_of_worker(None, gpus) is None
    assert cluster.gpu_of_worker(True, gpus) is None
    assert cluster.gpu_of_worker(1, ["0"]) is None  # one GPU: nothing to choose


def test_the_gpu_nanny_preload_gives_each_worker_of_a_machine_one_gpu(monkeypatch):
    """``dask worker --nworkers 2 --name pod --preload-nanny plexrl_dask.gpu_nanny`` on a
    machine with GPUs 3 and 5: real nannies named as that command names them, each worker
    process started with its own GPU; a nanny whose config sets the variable keeps it."""
    import asyncio

    from distributed import Nanny, Scheduler

    monkeypatch.setattr(cluster, "visible_gpus", lambda: ["3", "5"])

    async def run() -> dict:
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            nannies = [
                Nanny(
                    s.address, name=f"pod-{k}", nthreads=1, preload_nanny=["plexrl_dask.gpu_nanny"]
                )
                for k in (0, 1)
            ]
            with dask.config.set({"distributed.nanny.environ": {"CUDA_VISIBLE_DEVICES": "9"}}):
                nannies.append(
                    Nanny(
                        s.address, name="pod-2", nthreads=1, preload_nanny=["plexrl_dask.gpu_nanny"]
                    )
                )
            try:
                await asyncio.gather(*nannies)
                async with Client(s.address, asynchronous=True) as c:
                    seen = await c.run(_cuda_env)
                    names = {w["name"]: a for a, w in s.identity()["workers"].items()}
                    return {name: seen[addr] for name, addr in names.items()}
            finally:
                await asyncio.gather(*(n.close() for n in nannies))

    assert asyncio.run(asyncio.wait_for(run(), 120)) == {"pod-0": "3", "pod-1": "5", "pod-2": "9"}


@pytest.mark.parametrize(
    "kwargs, settings",
    [
        ({"n_workers": 0}, {}),
        ({"threads_per_worker": -1}, {}),
        ({"memory_limit": "lots"}, {}),
        ({}, {"plexrl.local-cluster.tool-threads": "four", "plexrl.local-cluster.tool-workers": 1}),
    ],
)
def test_a_bad_local_cluster_setting_is_refused_before_anything_starts(kwargs, settings):
    """No tier is made and no process started for a cluster refused (a bad setting caught
    once the scheduler and the tiers were up left them behind)."""
    import glob
    import tempfile

    before = set(glob.glob(os.path.join(tempfile.gettempdir(), "plexrl-nvme-*")))
    with dask.config.set(settings), pytest.raises(ConfigError):
        plexrl.local_cluster(**kwargs)
    assert not set(glob.glob(os.path.join(tempfile.gettempdir(), "plexrl-nvme-*"))) - before
