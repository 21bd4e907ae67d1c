"""What ``plexrl serve`` keeps in its tables (sessions, training models, samplers, training
runs, promises) and the replies it sends for a finished promise."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from plexrl_dask.driver.deployment import Deployment
from plexrl_dask.driver.waits import settled
from plexrl_dask.errors import (
    ConfigError,
    InvalidTinkerRequest,
    RequestError,
    SamplerSuperseded,
    TenantLimitExceeded,
    UnknownObject,
    UnsupportedCall,
)

#: (HTTP status, body, media type) of a finished promise, as retrieve_future sends it
Reply = tuple[int, bytes, str]
JSON = "application/json"
PROTO = "application/x-protobuf"


def json_reply(body: Any) -> Reply:
    return 200, json.dumps(body).encode(), JSON


def error_body(exc: BaseException) -> dict[str, str]:
    """A failed request as the SDK reads it: ``error`` and ``category`` (``user`` for what
    the caller can fix)."""
    user = isinstance(exc, (RequestError, ConfigError, InvalidTinkerRequest, UnsupportedCall))
    user = user or isinstance(exc, (SamplerSuperseded, UnknownObject, TenantLimitExceeded))
    return {"error": f"{type(exc).__name__}: {exc}", "category": "user" if user else "server"}


@dataclass
class Promise:
    request_id: str
    tenant: str
    kind: str
    task: asyncio.Task
    done_at: float | None = None  # (monotonic) when its reply was ready


@dataclass
class Session:
    session_id: str
    tenant: str
    last_seen: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    #: loss id -> the custom loss (a GraphLoss) its clients made (create_custom_loss)
    losses: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainModel:
    model_id: str
    tenant: str
    session_id: str
    base: str
    deployment: Deployment
    #: the LoRA adapter's LoraSpec dict; None: full fine-tuning
    lora: dict | None = None
    next_seq: int = 1
    #: seq_id -> request id, for every seq_id taken (a retry gets its first request id back)
    taken: dict[int, str] = field(default_factory=dict)
    #: seq_id -> (what submits it, the future its promise waits on for the Dask future)
    waiting: dict[int, tuple[Callable[[], Any], asyncio.Future]] = field(default_factory=dict)
    optim_steps: int = 0  # submitted
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    gap_check: asyncio.TimerHandle | None = None


@dataclass
class Sampler:
    sampler_id: str
    tenant: str
    base: str
    deployment: Deployment
    model_id: str | None = None  # a session on a training model's own replica
    version: int | None = None  # ... at this many optimizer steps (None: it follows them)
    model_path: str | None = None
    owned: bool = False  # its deployment is this sampler's own (undeployed with it)
    # its calls merged into requests (serve/coalesce.py), made with its first call
    merger: Any = field(default=None, repr=False, compare=False)
    # a snapshot's copy of its weights, kept past its model's next step (serve/snapshots.py)
    kept: KeptCopy | None = field(default=None, repr=False, compare=False)
    # on an adapter bank (``deployment``): its adapter's key there (None: the base), and the
    # future of the adapter's load
    adapter: str | None = None
    loading: Any = field(default=None, repr=False, compare=False)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)


@dataclass(eq=False)
class KeptCopy:
    """A snapshot's copy of its model's weights in the store, shared by the snapshot samplers
    of one step: ``saved`` is the ``save_state`` future until :meth:`stored` has its result,
    and that plain dict from then on (fetched as soon as the save ends: a future whose worker
    is lost would run the save again, on a training replica that may be gone with it);
    ``lora`` is the model's LoRA dict (None: full weights)."""

    saved: Any
    lora: dict | None

    async def stored(self) -> dict:
        """The ``save_state`` result (waited for once)."""
        if not isinstance(self.saved, dict):
            self.saved = dict(await settled(self.saved))
        return self.saved


@dataclass(frozen=True)
class Run:
    run_id: str
    tenant: str
    base: str
    user_metadata: dict
    created: str = field(default_factory=lambda: datetime.now(UTC).isoformat())
    lora: dict | None = None
