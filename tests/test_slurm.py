"""PlexRL on SLURM through dask-jobqueue.

The job script tests need no SLURM. The others run against a real SLURM cluster on this
machine (``tools/slurm-local start``, which ``.ci/run`` does: munged, slurmctld and one slurmd
per node) and are skipped with the reason where none answers: real jobs submitted with
``sbatch``, workers joining with the PlexRL plugins, GRPO jobs on them, a job cancelled with
``scancel`` mid-run (preemption) and one submitted later."""

from __future__ import annotations

import json
import subprocess
import sys

import dask
import pytest
from distributed import Client

import plexrl_dask as plexrl
from plexrl_dask import errors, slurm
from plexrl_dask.bench import slurm as scenario
from plexrl_dask.cli import main as plexrl_main
from plexrl_dask.slurm import jobqueue_options


def test_a_slurm_cluster_is_a_plexrl_cluster_before_any_job_is_submitted(tmp_path):
    """dask-jobqueue's SLURMCluster with PlexRL's options (no SLURM here: nothing is submitted):
    its scheduler, in this process, runs the PlexRL plugins and speaks TLS, and its job script
    starts one worker per job with the GPU resource, one GPU and the cluster's certificate
    (workers that may have children when the rollout is vLLM), and gives them the driver's
    PlexRL settings (not its secret); the site's own options are kept beside PlexRL's."""
    site = dict(
        cores=1,
        memory="1GB",
        scheduler_options={"host": "127.0.0.1"},
        shared_temp_directory=str(tmp_path),
    )
    driver = {
        "plexrl.worker.timeline-length": 123,
        "plexrl.scheduler.job-weights": {"Job A": 2},
        "plexrl.operator-secret": "an-operator-secret-not-in-scripts",
    }
    with (
        dask.config.set(driver),
        plexrl.slurm_cluster(
            2, submit=False, worker_extra_args=["--lifetime", "3h"], **site
        ) as cluster,
    ):
        assert "plexrl" in cluster.scheduler.plugins
        assert cluster.scheduler.address.startswith("tls://127.0.0.1:")
        script = cluster.job_script()
        assert "#SBATCH --gres=gpu:1" in script
        assert "--resources GPU=1" in script and "--lifetime 3h" in script
        assert "DAEMON" not in script
        assert "tls://127.0.0.1:" in script and f"--tls-key {tmp_path}/" in script
        # (what a worker's shell and Dask make of the exports: the driver's values)
        exports = [line for line in script.splitlines() if line.startswith("export DASK_PLEXRL")]
        keys = ["plexrl.worker.timeline-length", "plexrl.scheduler.job-weights"]
        read = f"import json, plexrl_dask, dask; print(json.dumps([dask.config.get(k) for k in {keys}]))"
        shell = [*exports, f'{sys.executable} -c "{read}"']
        out = subprocess.run(["bash", "-c", "\n".join(shell)], capture_output=True, text=True)
        assert json.loads(out.stdout) == [123, {"Job A": 2}]
        assert "not-in-scripts" not in script and "OPERATOR" not in script
        assert not cluster.workers  # nothing submitted
    with plexrl.slurm_cluster(1, submit=False, tls=False, **site) as cluster:
        assert cluster.scheduler.address.startswith("tcp://127.0.0.1:")
        assert "--tls" not in cluster.job_script()
        assert "DASK_PLEXRL__WORKER" not in cluster.job_script()
    with plexrl.slurm_cluster(1, "vllm", submit=False, **site) as cluster:
        assert "export DASK_DISTRIBUTED__WORKER__DAEMON=False" in cluster.job_script()
    # the site's dask-jobqueue config (its environment, its directives) is kept too, and the
    # workers run without Dask's malloc trim threshold
    jobqueue = {
        "jobqueue.slurm.job-script-prologue": ["source /site/venv/bin/activate"],
        "jobqueue.slurm.job-extra-directives": ["--qos=high"],
        "jobqueue.slurm.worker-extra-args": ["--lifetime", "2h"],
    }
    with dask.config.set(jobqueue), plexrl.slurm_cluster(1, submit=False, **site) as cluster:
        script = cluster.job_script()
        assert "source /site/venv/bin/activate" in script and "#SBATCH --qos=high" in script
        assert "#SBATCH --gres=gpu:1" in script and "--lifetime 2h" in script
        assert "PRE_SPAWN_ENVIRON__MALLOC_TRIM_THRESHOLD_=None" in script
        # the node's DRAM tier is sized by the job's memory (its files count against it)
        assert "DASK_PLEXRL__STATE__DRAM_CAPACITY=250000000" in script  # (1GB / 4)
    with pytest.raises(errors.ConfigError, match="rollout_backend"):
        jobqueue_options("tensorrt")
    with (
        pytest.raises(errors.ConfigError, match="gpus"),
        plexrl.slurm_cluster(0, submit=False, **site),
    ):
        pass


def test_a_slurm_job_of_several_gpus_runs_one_worker_per_gpu():
    """``gpus_per_job=4``: jobs asking for 4 GPUs, each starting 4 workers (``--nworkers``,
    so named ``<job>-0`` ... ``-3``) with the GPU nanny preload, which gives each one of the
    job's GPUs (tested above with real nannies)."""
    site = dict(cores=8, memory="64GB", scheduler_options={"host": "127.0.0.1"})
    with plexrl.slurm_cluster(8, submit=False, gpus_per_job=4, **site) as cluster:
        script = cluster.job_script()
        assert "#SBATCH --gres=gpu:4" in script
        [worker] = [line for line in script.splitlines() if "dask_worker" in line]
        assert "--nworkers 4" in worker and "--nthreads 2" in worker
        assert "--resources GPU=1 --preload-nanny plexrl_dask.gpu_nanny" in worker
    for bad, match in (({"gpus_per_job": 0}, "gpus_per_job"), ({"gpus_per_job": 3}, "multiple")):
        with (
            pytest.raises(errors.ConfigError, match=match),
            plexrl.slurm_cluster(8, submit=False, **bad, **site),
        ):
            pass


def test_sigterm_while_plexrl_slurm_starts_closes_what_it_holds():
    """``plexrl slurm`` runs its cluster inside ``_terminate_exits``: a SIGTERM there raises
    SystemExit, so the jobs are cancelled and the client credentials removed on the way out
    (by default it would end the process on the spot); the handler before it, after."""
    import signal

    from plexrl_dask.cli import _terminate_exits

    before = signal.getsignal(signal.SIGTERM)
    closed = []
    with pytest.raises(SystemExit) as ended, _terminate_exits():
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            closed.append(True)
    assert ended.value.code == 143 and closed == [True]
    assert signal.getsignal(signal.SIGTERM) is before


# --- on a real SLURM cluster -----------------------------------------------------------------

NO_SLURM = slurm.environment_problem()
needs_slurm = pytest.mark.skipif(NO_SLURM is not None, reason=str(NO_SLURM))
STEPS = 4


@needs_slurm
def test_slurm_refusals_pending_jobs_and_broken_workers_are_typed_and_named(tmp_path, capsys):
    """A partition SLURM refuses: BatchJobRefused with SLURM's words, before any job is
    submitted; jobs that pend past the wait: WorkersNotStarted with their state and reason;
    a worker without the GPU resource, or whose holder fails: PluginsNotInstalled naming it.
    The ``plexrl slurm`` command says each in one message and exits 2."""
    site = slurm.one_machine_site(tmp_path)
    with (
        pytest.raises(errors.BatchJobRefused, match="invalid partition"),
        slurm.slurm_cluster(1, queue="no-such-partition", **site),
    ):
        pass
    later = {**site, "job_extra_directives": ["--gres=gpu:1", "--begin=now+1hour"]}
    with (
        slurm.slurm_cluster(1, **later) as cluster,
        Client(cluster) as client,
        pytest.raises(errors.WorkersNotStarted, match=r"PENDING \(BeginTime\)"),
    ):
        slurm.wait_for_plexrl_workers(client, 1, 2, cluster)
    no_gpu = {**site, "worker_extra_args": ["--host", "127.0.0.1", "--resources", "CPU=1"]}
    # (a worker setting that is wrong: its holder fails, naming the setting)
    broken = {**site, "job_script_prologue": ["export DASK_PLEXRL__WORKER__TORCH_THREADS=0"]}
    for kwargs, match in (
        (no_gpu, "does not advertise the GPU"),
        (broken, "holders failed.*torch-threads"),
    ):
        with slurm.slurm_cluster(1, **kwargs) as cluster, Client(cluster) as client:
            client.wait_for_workers(1, timeout=scenario.WORKER_WAIT_S)
            with pytest.raises(errors.PluginsNotInstalled, match=match):
                slurm.wait_for_plexrl_workers(client, 1, 3, cluster)
    common = ["--scheduler-host", "127.0.0.1", "--dashboard", ":0", "--cores", "1"]
    common += ["--shared-dir", str(tmp_path), "--tls-dir", str(tmp_path / "clients")]
    assert plexrl_main(["slurm", "1", "--queue", "nope", *common, "--memory", "1GB"]) == 2
    refused = capsys.readouterr().err
    assert "BatchJobRefused" in refused and "invalid partition" in refused
    pending = ["--directive=--begin=now+1hour", "--wait", "2", "--memory", "1GB"]
    assert plexrl_main(["slurm", "1", *common, *pending]) == 2
    assert "WorkersNotStarted" in capsys.readouterr().err


@pytest.fixture(scope="module")
def on_slurm(tmp_path_factory):
    """Two PlexRL workers from two SLURM jobs (one per node), and the client."""
    if NO_SLURM is not None:
        pytest.skip(NO_SLURM)
    site = slurm.one_machine_site(tmp_path_factory.mktemp("slurm"))
    with (
        dask.config.set(DRIVER_SETTING),  # (for the workers: their jobs' scripts carry it)
        slurm.slurm_cluster(2, **site) as cluster,
        Client(cluster) as client,
    ):
        slurm.wait_for_plexrl_workers(client, 2, scenario.WORKER_WAIT_S, cluster)
        yield cluster, client


#: A PlexRL setting made in the driver, which the SLURM jobs' workers get too.
DRIVER_SETTING = {"plexrl.worker.timeline-length": 4321}


@pytest.fixture(scope="module")
def uninterrupted(on_slurm):
    """The two GRPO jobs' records, run without a fault on the SLURM workers."""
    _, client = on_slurm
    records, _ = scenario.two_jobs(client, STEPS, "whole")
    return records


@needs_slurm
def test_slurm_jobs_start_plexrl_workers_whose_nodes_are_slurms_and_grpo_runs_as_locally(
    on_slurm, uninterrupted
):
    """Each submitted job's worker joins with the PlexRL plugins, over TLS, with the driver's
    PlexRL settings, and reports the node SLURM ran it on; the placer's nodes are those; two
    GRPO jobs multiplexed there compute exactly what they compute on a local cluster."""
    cluster, client = on_slurm
    assert cluster.scheduler_address.startswith("tls://")
    [(key, value)] = DRIVER_SETTING.items()
    seen = client.run(lambda: (dask.config.get(key), dask.config.get("plexrl.state.node-id")))
    assert len(seen) == 2 and all(got == (value, "auto") for got in seen.values())
    assert all(w.startswith("tls://") for w in seen)
    reports = slurm.wait_for_plexrl_workers(client, 2, 10)
    nodes = sorted(r["node"] for r in reports.values())
    assert nodes == slurm.slurm_nodes() == ["n1", "n2"]
    jobs = slurm.slurm_jobs(list(slurm.job_ids(cluster).values()))
    assert sorted(j.nodes for j in jobs.values() if j.state == "RUNNING") == nodes
    placer = plexrl.Runtime(client, job="slurm-probe").placement()
    assert sorted(n["name"] for n in placer["nodes"]) == nodes
    assert any(r[3] is not None for rs in uninterrupted.values() for r in rs)  # it trained
    with plexrl.local_cluster(n_workers=2) as local, Client(local) as local_client:
        here, _ = scenario.two_jobs(local_client, STEPS, "local")
    assert here == uninterrupted


@needs_slurm
def test_a_preempted_worker_sends_its_job_back_to_its_checkpoint_and_a_later_job_adds_one(
    on_slurm, uninterrupted, tmp_path
):
    """After job a's step 2 the SLURM job of the worker holding a's policy is cancelled
    (scancel): its trained state is gone, the job goes back to its checkpoint on the worker
    that is left, and both jobs end with exactly the uninterrupted records. A job submitted
    afterwards adds a worker that the placer gives to a new job's group."""
    cluster, client = on_slurm
    hook, cancelled = scenario.preempt_after(cluster, client, "a", STEPS // 2)
    records, jobs = scenario.two_jobs(client, STEPS, "preempted", tmp_path / "ck", hook)
    assert len(cancelled) == 1
    assert all(j.state != "RUNNING" for j in slurm.slurm_jobs(cancelled).values())
    assert len(jobs["a"].recoveries) == 1 and "DeploymentLost" in jobs["a"].recoveries[0]
    assert records == uninterrupted
    assert scenario.scaled_up_worker_used(cluster, client)
