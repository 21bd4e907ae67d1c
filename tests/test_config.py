"""Configuration and constructor input: every bad value is a typed error that names it."""

from __future__ import annotations

import math

import dask
import pytest

import plexrl_dask as plexrl
from plexrl_dask import config, errors
from plexrl_dask.policy.spatiotemporal import PlacementConfig, replay


@pytest.mark.parametrize("value", [None, "ten", "-5s", -1, 0, "0s", math.inf, "nan"])
def test_a_bad_duration_is_a_config_error_naming_the_key(value):
    with (
        dask.config.set({"plexrl.request.timeout": value}),
        pytest.raises(errors.ConfigError, match="plexrl.request.timeout"),
    ):
        config.request_timeout()


def test_durations_parse_units_and_zero_only_where_allowed():
    with dask.config.set({"plexrl.request.timeout": "250ms"}):
        assert config.request_timeout() == 0.25
    with dask.config.set({"plexrl.scheduler.patience-floor": 0}):
        assert config.get_seconds("scheduler.patience-floor", positive=False) == 0.0
        with pytest.raises(errors.ConfigError):
            config.get_seconds("scheduler.patience-floor")


def test_a_null_dashboard_interval_is_a_config_error():
    with (
        dask.config.set({"plexrl.dashboard.update-interval": None}),
        pytest.raises(errors.ConfigError, match="update-interval"),
    ):
        config.DashboardConfig.from_dask_config()


@pytest.mark.parametrize(
    "key,value", [("slots", "many"), ("reserve-quantile", None), ("packing", "diagonal")]
)
def test_bad_placement_settings_are_config_errors(key, value):
    assert isinstance(config.placement_config(), PlacementConfig)
    with (
        dask.config.set({f"plexrl.placement.{key}": value}),
        pytest.raises(errors.ConfigError, match="plexrl.placement"),
    ):
        config.placement_config()


@pytest.mark.parametrize(
    "kwargs",
    [{"intermediate_size": -8}, {"intermediate_size": 0}, {"hidden_size": 64.0}, {"seed": "1"}],
)
def test_tiny_model_sizes_are_checked_before_anything_is_built(kwargs):
    with pytest.raises(errors.InvalidModelSpec):
        plexrl.ModelSpec.tiny(**kwargs)


@pytest.mark.parametrize(
    "event",
    [
        {"event": "profiled", "job": "j", "now": 1.0},  # no trace
        {"event": "submit", "job": "j", "now": 1.0},  # no gpus
        {"event": "add_node", "node": "n", "gpus": [0], "now": "later"},
        {"job": "j"},  # no event
    ],
)
def test_replaying_malformed_placement_inputs_is_an_invalid_trace(event):
    with pytest.raises(errors.InvalidTrace, match="placement input 0"):
        replay([], PlacementConfig(), [event])


def test_batched_streams_get_the_configured_interval_or_keep_dasks():
    from distributed.batched import BatchedSend

    stream = BatchedSend(interval="10ms")
    assert config.tune_batched_send(stream) and stream.interval == 0.001
    with dask.config.set({"plexrl.comm.batch-interval": None}):
        other = BatchedSend(interval="10ms")
        assert not config.tune_batched_send(other) and other.interval == 0.01
    with dask.config.set({"plexrl.comm.batch-interval": "0ms"}):
        assert config.tune_batched_send(stream) and stream.interval == 0.0
    with (
        dask.config.set({"plexrl.comm.batch-interval": "soon"}),
        pytest.raises(errors.ConfigError, match="batch-interval"),
    ):
        config.tune_batched_send(stream)
    assert not config.tune_batched_send(None)  # (a client not connected yet)


def test_a_cluster_and_its_runtime_use_the_configured_interval(client):
    """Every hop of a request: the driver's stream to the scheduler, the scheduler's to the
    workers and to the driver, each worker's to the scheduler."""
    runtime = plexrl.Runtime(client, job="interval-check")
    assert client.scheduler_comm.interval == 0.001
    policy = runtime.deploy("interval-policy", plexrl.ModelSpec.tiny(hidden_size=32, num_layers=1))
    plexrl.result(policy.forward([plexrl.Datum(tokens=[1, 5])]))  # (a routed request)
    workers = client.run(lambda dask_worker: dask_worker.batched_stream.interval)
    assert set(workers.values()) == {0.001}
    on_scheduler = client.run_on_scheduler(
        lambda dask_scheduler, me=client.id: (
            {b.interval for b in dask_scheduler.stream_comms.values()},
            dask_scheduler.client_comms[me].interval,
        )
    )
    assert on_scheduler == ({0.001}, 0.001)
    runtime.undeploy("interval-policy")


@pytest.mark.parametrize(
    "key, value",
    [
        ("torch-threads", 0),
        ("torch-threads", "two"),
        ("memory-budget", "90%"),
        ("memory-budget", -1),
        ("gpu-resource", ""),
        ("timeline-length", 0),
    ],
)
def test_a_bad_worker_setting_is_a_config_error_naming_it(key, value):
    """Read where a worker starts (its plugin, its holder): a wrong one is said there, by
    name, and reaches ``holder_errors`` (not a worker up with no holder and no reason)."""
    assert config.WorkerConfig.from_dask_config().torch_threads >= 1
    with (
        dask.config.set({f"plexrl.worker.{key}": value}),
        pytest.raises(errors.ConfigError, match=key),
    ):
        config.WorkerConfig.from_dask_config()


def test_the_printed_config_does_not_show_the_operator_secret(capsys):
    from plexrl_dask.cli import main

    with dask.config.set({"plexrl.operator-secret": "s3cret-value"}):
        assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "s3cret-value" not in out and "operator-secret" in out and "request" in out


def test_settings_shipped_to_workers_elsewhere_are_the_changed_ones_and_never_the_secret():
    """``shipped_settings``: what differs from the defaults, as ``DASK_PLEXRL__`` variables
    that read back as set; never the operator secret, the node id or the journal, whether set
    in the driver's Dask config or by its own environment (whose keys Dask keeps with
    underscores); a value that would not read back is a ConfigError naming it."""
    import json
    import os
    import subprocess
    import sys

    driver = {
        "plexrl.worker.timeline-length": 7,
        "plexrl.scheduler.load-bandwidth-priors.dram": "20GB",
        "plexrl.operator-secret": "s" * 16,
        "plexrl.scheduler.journal": "/driver/journal.sqlite",
        "plexrl.serve.keys-file": "/driver/keys",
    }
    with dask.config.set(driver):
        assert config.shipped_settings() == {
            "DASK_PLEXRL__WORKER__TIMELINE_LENGTH": "7",
            "DASK_PLEXRL__SCHEDULER__LOAD_BANDWIDTH_PRIORS__DRAM": "'20GB'",
        }
    env = {
        **os.environ,
        "DASK_PLEXRL__OPERATOR_SECRET": "e" * 16,
        "DASK_PLEXRL__STATE__NODE_ID": "the-driver",
        "DASK_PLEXRL__LOCAL_CLUSTER__N_WORKERS": "3",
        "DASK_PLEXRL__WORKER__TIMELINE_LENGTH": "9",
    }
    code = "import json, plexrl_dask.config as c; print(json.dumps(c.shipped_settings()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert json.loads(out.stdout) == {"DASK_PLEXRL__WORKER__TIMELINE_LENGTH": "9"}, out.stderr
    for bad in (float("inf"), float("nan")):
        with (
            dask.config.set({"plexrl.request.timeout": bad}),
            pytest.raises(errors.ConfigError, match="plexrl.request.timeout"),
        ):
            config.shipped_settings()
