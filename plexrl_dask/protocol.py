"""Every name that crosses a process boundary: the wire protocol between driver, scheduler and
workers, in one place.

PlexRL's processes talk through Dask's own channels (docs/architecture.md, "Processes"):

- a **task annotation** (``plexrl={...}``) marks a request; the scheduler plugin routes it;
- **scheduler handlers** (``client.scheduler.<name>(...)``) reach the deployment registry, the
  dispatcher's status and the process groups' rendezvous;
- **worker handlers** (``rpc(worker).<name>(...)``) reach a replica holder and the node's
  stored versions;
- **events** (``worker.log_event(topic, msg)``, ``client.log_event(topic, msg)``) report
  residency, holders, joining workers and job steps to scheduler plugins;
- a **worker stream op** carries the scheduler's prefetch hints.

The records that travel with them are defined where their meaning is: the residency report
(:mod:`plexrl_dask.policy.residency`), a deployment's record
(:mod:`plexrl_dask.shared.records`), requests and results (:mod:`plexrl_dask.shared.types`),
a job's step report (:mod:`plexrl_dask.dashboard.jobs`). This module imports nothing: the
scheduler, the workers and the driver all load it.
"""

from __future__ import annotations

#: The task annotation that makes a task a PlexRL request (``dask.annotate(plexrl={...})``).
ANNOTATION = "plexrl"
#: A worker address that never exists: restricting a task to it parks it in ``no-worker``.
PARKED = "plexrl-parked://nowhere"

# --- scheduler handlers (the scheduler plugin's, plugins/scheduler.py) ----------------------

DEPLOY = "plexrl_deploy"
UNDEPLOY = "plexrl_undeploy"
GET_DEPLOYMENT = "plexrl_get_deployment"
LIST_DEPLOYMENTS = "plexrl_list_deployments"
STATUS = "plexrl_status"
SET_POLICY = "plexrl_set_policy"
RENDEZVOUS_PUT = "plexrl_rendezvous_put"
RENDEZVOUS_GET = "plexrl_rendezvous_get"
PLACEMENT = "plexrl_placement"
RELOCATIONS = "plexrl_relocations"
RELOCATE = "plexrl_relocate"
SHARE = "plexrl_share"
REGISTER_JOB = "plexrl_register_job"
OFFLOAD = "plexrl_offload"
#: The handlers a caller runs in a job's name: it presents the job's ``secret`` with them.
ACTS_AS_JOB = frozenset({DEPLOY, UNDEPLOY, RELOCATE, SHARE, OFFLOAD})

# --- worker handlers (plugins/worker.py) ------------------------------------------------------

#: A replica holder's status (``runtime.holder`` and the CLI read it).
HOLDER_STATUS = "plexrl_holder_status"
#: Drop a deployment's replica from a holder (undeployed, or placed elsewhere).
HOLDER_DROP = "plexrl_holder_drop"
#: Offload a deployment's replica to host memory now (its owner asked, through the scheduler).
HOLDER_OFFLOAD = "plexrl_holder_offload"
#: A stored version's manifest, and the objects another node lacks (state_store/peer.py).
STORE_MANIFEST = "plexrl_store_manifest"
STORE_OBJECTS = "plexrl_store_objects"

# --- events -----------------------------------------------------------------------------------

#: A deployment's residency on a worker changed (a ``ResidencyReport``; sent by holders).
RESIDENCY_TOPIC = "plexrl-residency"
#: A GPU worker joined and wants a replica holder (sent by the worker plugin).
WORKER_TOPIC = "plexrl-worker"
#: A replica holder exists on a worker: its capacity and actor key (sent by the holder).
HOLDER_TOPIC = "plexrl-holder"
#: A job finished a step (a ``JobStepReport``; sent by drivers, read by the dashboard).
JOB_TOPIC = "plexrl-job"

# --- worker stream ops ------------------------------------------------------------------------

#: The scheduler's prefetch hint to a worker (``deployment``, ``uid``).
PREFETCH_OP = "plexrl-prefetch"
