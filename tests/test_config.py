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
