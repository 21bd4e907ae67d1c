"""Shared fixtures: real process LocalClusters with the PlexRL plugins.

Starting a cluster and importing torch in its workers takes seconds, so one 2-worker cluster is
shared by all tests of a module (tests use unique deployment names); tests that break workers or
change their budget get their own. Module scope, not session: gen_cluster tests (test_plugin.py)
fail on worker processes that outlive another module.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping

import pytest
from distributed import Client, Event
from hypothesis import settings

import plexrl_dask as plexrl

# Property tests explore fresh examples on every developer run; CI (.ci/run sets
# HYPOTHESIS_PROFILE=ci) replays a fixed set, so a green run at a commit stays green on CI and
# a failure there is a real regression, not a newly drawn example. print_blob makes any failure
# reproducible with @reproduce_failure.
settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

TINY = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, max_positions=64)


def tiny_spec(seed: int = 0, **overrides) -> plexrl.ModelSpec:
    return plexrl.ModelSpec.tiny(**{**TINY, **overrides}, seed=seed)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def node_state(tiers: Mapping[str, object]):
    """A client of the node whose ``plexrl.state.*`` settings are ``tiers`` (``dram-path``,
    ``nvme-path``, ...): its manager's status and stores, or ``shutdown()`` to stop it."""
    from plexrl_dask.state_store.node import NodeState, StateConfig

    return NodeState(StateConfig.for_tiers(tiers))


@pytest.fixture(scope="module")
def cluster():
    with plexrl.local_cluster(n_workers=2) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    # Not the process's default client: gen_cluster tests in the same process build their own
    # event loops, and a default client on another loop leaks into them (via get_client()).
    with Client(cluster, set_as_default=False) as c:
        yield c


@pytest.fixture
def runtime(client):
    return plexrl.Runtime(client, job=unique("test-job"))


def hold(deployment: str, gate: str, timeout: float, *inputs: object) -> str:
    """A PlexRL-routed request (submit it under a ``plexrl`` annotation naming ``deployment``)
    that keeps its worker until the distributed Event ``gate`` is set. ``inputs``: futures to
    depend on, which makes it a request that takes inputs."""
    if not Event(gate).wait(timeout=timeout):
        raise TimeoutError(f"gate {gate} stayed closed for {timeout}s")
    return deployment
