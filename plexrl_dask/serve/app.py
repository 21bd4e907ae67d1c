"""The HTTP surface of ``plexrl serve``: the Tinker SDK's endpoints on a FastAPI app.

Every route but ``/api/v1/healthz`` needs an ``X-API-Key`` of a tenant (:mod:`.tenants`);
long calls answer at once with a request id and are fetched with ``retrieve_future``, which
waits up to ``plexrl.serve.long-poll`` seconds and then answers 408 ``try_again`` (the SDK polls
again, quietly). A refused call answers a typed error body ``{"detail", "error"}``: 400 for
what the caller sent (a malformed body, an unsupported loss or call), 401 for a missing or
unknown key, 404 for an id the tenant does not have (another tenant's included), 403 past a
tenant's limits, 413 for a body past its byte limit, 429 (retried by the SDK) while the
tenant's requests waiting are at their limit. Any path this server does not implement answers
400 ``UnsupportedCall`` naming the ones it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from dask.utils import parse_bytes

from plexrl_dask import config
from plexrl_dask.errors import (
    ConfigError,
    InvalidTinkerRequest,
    PlexRLError,
    QuotaExceeded,
    RequestTooLarge,
    TenantBusy,
    TenantLimitExceeded,
    Unauthenticated,
    UnknownObject,
    UnsupportedCall,
)
from plexrl_dask.serve import wire
from plexrl_dask.serve.records import JSON, json_reply
from plexrl_dask.serve.rest import RestApi
from plexrl_dask.serve.service import Service
from plexrl_dask.serve.tenants import KeyRing, Tenant

try:  # (the serve extra; routes need these names at module level to resolve annotations)
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, Response
except ImportError:  # pragma: no cover - create_app says what to install
    FastAPI = Request = Response = FileResponse = None  # type: ignore[assignment,misc]

logger = logging.getLogger(__name__)

PREFIX = "/api/v1"
_STATUS: tuple[tuple[type[PlexRLError], int], ...] = (
    (TenantBusy, 429),
    (Unauthenticated, 401),
    (UnknownObject, 404),
    (RequestTooLarge, 413),
    (TenantLimitExceeded, 403),
    (QuotaExceeded, 403),
)


def http_status(exc: PlexRLError) -> int:
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 400


def create_app(
    client: Any, keyring: KeyRing, models: dict[str, str], state_file: str | None = None
) -> Any:
    """The FastAPI app of a server on ``client``'s cluster: tenants from ``keyring``, base
    models ``models`` (name -> local checkpoint directory), what outlives a restart in
    ``state_file`` (:mod:`.state`; None: nothing)."""
    if wire.pb is None or FastAPI is None:
        raise ConfigError("plexrl serve needs the serve extra: pip install 'plexrl-dask[serve]'")
    service = Service(client, models, state_file)
    rest = RestApi(service)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        service.loop = asyncio.get_running_loop()
        sweeper = asyncio.ensure_future(_sweep(service))
        try:
            yield
        finally:
            sweeper.cancel()
            service.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="plexrl serve (Tinker-compatible)", lifespan=lifespan)
    app.state.service = service

    def answer(status: int, body: bytes, media: str = JSON, **headers: str) -> Response:
        return Response(content=body, status_code=status, media_type=media, headers=headers)

    def ok(body: Any) -> Response:
        return answer(*json_reply(body))

    @app.exception_handler(PlexRLError)
    async def refused(request: Request, exc: PlexRLError) -> Response:
        status = http_status(exc)
        body = json.dumps({"detail": str(exc), "error": type(exc).__name__}).encode()
        extra = {"retry-after": "1"} if status == 429 else {}
        return answer(status, body, JSON, **extra)

    async def tenant_of(request: Request) -> Tenant:
        return keyring.tenant(request.headers.get("x-api-key"))

    async def body_of(request: Request, tenant: Tenant, cap: int | None = None) -> bytes:
        limit = tenant.limits.request_bytes
        limit = limit if cap is None else min(cap, limit)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestTooLarge(
                f"a request body of {declared} bytes is past this tenant's {limit}"
            )
        # Read as it arrives, refused once past the limit: a body sent without a length
        # (chunked) is never held whole first.
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(f"a request body past {limit} bytes (this tenant's limit)")
            chunks.append(chunk)
        return b"".join(chunks)

    async def json_of(request: Request, tenant: Tenant, cap: int | None = None) -> dict:
        raw = await body_of(request, tenant, cap)
        try:
            body = json.loads(raw or b"{}")
        except (ValueError, RecursionError) as e:
            raise InvalidTinkerRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise InvalidTinkerRequest("the body is a JSON object")
        return body

    def future(request_id: str, **extra: Any) -> Response:
        return ok({"request_id": request_id, **extra})

    # --- bootstrap and sessions ------------------------------------------------------------

    @app.get(f"{PREFIX}/healthz")
    async def healthz() -> Response:
        return ok({"status": "ok"})

    @app.post(f"{PREFIX}/client/config")
    async def client_config(request: Request) -> Response:
        await tenant_of(request)
        # plain httpx (no pyqwest transport); custom losses run here unless configured off
        server_side = service.custom_losses
        return ok({"use_pyqwest_transport": False, "custom_loss_server_side": server_side})

    @app.post(f"{PREFIX}/client/dynamic_config")
    async def dynamic_config(request: Request) -> Response:
        await tenant_of(request)
        return ok({"sample_cancel_enabled": False})

    @app.get(f"{PREFIX}/get_server_capabilities")
    async def capabilities(request: Request) -> Response:
        await tenant_of(request)
        models = [
            {
                "model_name": name,
                "max_context_length": service.context(name),
                "trainable": True,
                "sampleable": True,
            }
            for name in service.catalog
        ]
        return ok({"supported_models": models})

    @app.post(f"{PREFIX}/create_session")
    async def create_session(request: Request) -> Response:
        tenant = await tenant_of(request)
        await json_of(request, tenant)
        return ok({"session_id": service.create_session(tenant)})

    @app.post(f"{PREFIX}/session_heartbeat")
    async def heartbeat(request: Request) -> Response:
        tenant = await tenant_of(request)
        service.session(tenant, str((await json_of(request, tenant)).get("session_id")))
        return ok({"type": "session_heartbeat"})

    @app.post(f"{PREFIX}/sessions/{{session_id}}/finish")
    async def finish(session_id: str, request: Request) -> Response:
        tenant = await tenant_of(request)
        await service.finish_session(tenant, session_id)
        return ok({})

    @app.post(f"{PREFIX}/telemetry")
    async def telemetry(request: Request) -> Response:
        await tenant_of(request)
        return ok({"status": "accepted"})

    # --- training --------------------------------------------------------------------------

    @app.post(f"{PREFIX}/get_info")
    async def get_info(request: Request) -> Response:
        tenant = await tenant_of(request)
        body = await json_of(request, tenant)
        return ok(service.get_info(tenant, str(body.get("model_id"))))

    @app.post(f"{PREFIX}/forward_backward")
    async def forward_backward(request: Request) -> Response:
        tenant = await tenant_of(request)
        if request.headers.get("content-encoding", "identity") != "identity":
            raise UnsupportedCall("compressed forward_backward bodies are not supported")
        raw = await body_of(request, tenant)
        if "protobuf" not in request.headers.get("content-type", ""):
            raise InvalidTinkerRequest("forward_backward takes an application/x-protobuf body")
        return future(await service.forward_backward(tenant, raw))

    def json_future(path: str, call: Any) -> None:
        """A route whose JSON body starts ``call(tenant, body)``, answered with its request
        id."""

        async def route(request: Request) -> Response:
            tenant = await tenant_of(request)
            return future(await call(tenant, await json_of(request, tenant)))

        route.__name__ = path
        app.post(f"{PREFIX}/{path}")(route)

    for path in (
        "create_model",
        "optim_step",
        "save_weights_for_sampler",
        "save_weights",
        "save_weights_external",
        "load_weights",
    ):
        json_future(path, getattr(service, path))

    @app.post(f"{PREFIX}/create_custom_loss")
    async def create_custom_loss(request: Request) -> Response:
        tenant = await tenant_of(request)
        cap = parse_bytes(config.get("serve.custom-loss-bytes"))  # (a graph, not a batch)
        body = await json_of(request, tenant, cap)
        return future(await service.create_custom_loss(tenant, body))

    def described(path: str, call: Any) -> None:
        """``GET path/{id}``: what ``call(tenant, id)`` says of the tenant's object."""

        async def route(request: Request) -> Response:
            tenant = await tenant_of(request)
            return ok(call(tenant, request.path_params["object_id"]))

        route.__name__ = path
        app.get(f"{PREFIX}/{path}/{{object_id}}")(route)

    described("training_runs", rest.training_run)
    described("samplers", service.describe_sampler)

    # --- checkpoints and training runs (the SDK's RestClient) ------------------------------

    def query(request: Request, name: str, default: Any) -> Any:
        return request.query_params.get(name, default)

    @app.get(f"{PREFIX}/training_runs")
    async def list_training_runs(request: Request) -> Response:
        tenant = await tenant_of(request)
        if query(request, "project_id", None) is not None:
            raise UnsupportedCall("projects are not supported: list without project_id")
        limit, offset = query(request, "limit", 20), query(request, "offset", 0)
        return ok(rest.list_runs(tenant, limit, offset))

    @app.get(f"{PREFIX}/training_runs/{{run_id}}/checkpoints")
    async def list_checkpoints(request: Request, run_id: str) -> Response:
        return ok(rest.list_checkpoints(await tenant_of(request), run_id))

    @app.get(f"{PREFIX}/checkpoints")
    async def list_user_checkpoints(request: Request) -> Response:
        tenant = await tenant_of(request)
        limit, offset = query(request, "limit", 100), query(request, "offset", 0)
        return ok(rest.list_user_checkpoints(tenant, limit, offset))

    @app.delete(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}")
    async def delete_checkpoint(request: Request, run_id: str, checkpoint_id: str) -> Response:
        await rest.delete_checkpoint(await tenant_of(request), run_id, checkpoint_id)
        return ok(None)

    @app.put(f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/ttl")
    async def checkpoint_ttl(request: Request, run_id: str, checkpoint_id: str) -> Response:
        tenant = await tenant_of(request)
        rest.set_ttl(tenant, run_id, checkpoint_id, await json_of(request, tenant))
        return ok(None)

    @app.post(f"{PREFIX}/weights_info")
    async def weights_info(request: Request) -> Response:
        tenant = await tenant_of(request)
        return ok(rest.weights_info(tenant, await json_of(request, tenant)))

    @app.get(
        f"{PREFIX}/training_runs/{{run_id}}/checkpoints/{{checkpoint_id:path}}/external_weights_urls"
    )
    async def external_weights_urls(request: Request, run_id: str, checkpoint_id: str) -> Response:
        tenant = await tenant_of(request)
        base = str(request.base_url)
        return ok(rest.export_urls(tenant, run_id, checkpoint_id, base))

    @app.get(f"{PREFIX}/exports/{{run_id}}/{{checkpoint_id:path}}/{{file}}")
    async def export_file(request: Request, run_id: str, checkpoint_id: str, file: str) -> Any:
        """A signed URL's file (no API key: the signature is the permission)."""
        expires, signature = query(request, "expires", None), query(request, "signature", None)
        path = rest.export_file(run_id, checkpoint_id, file, expires, signature)
        return FileResponse(path, filename=file)

    # --- sampling --------------------------------------------------------------------------

    @app.post(f"{PREFIX}/create_sampling_session")
    async def create_sampling_session(request: Request) -> Response:
        tenant = await tenant_of(request)
        body = await json_of(request, tenant)
        return ok({"sampling_session_id": await service.create_sampling_session(tenant, body)})

    @app.post(f"{PREFIX}/asample")
    async def asample(request: Request) -> Response:
        tenant = await tenant_of(request)
        request_id, ids = service.sample(tenant, await json_of(request, tenant))
        return future(request_id, sample_sequence_ids=ids)

    # --- results ---------------------------------------------------------------------------

    @app.post(f"{PREFIX}/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        tenant = await tenant_of(request)
        body = await json_of(request, tenant)
        status, payload, media = await service.retrieve(tenant, str(body.get("request_id")))
        return answer(status, payload, media)

    implemented = sorted(
        f"{sorted(r.methods)[0]} {r.path}"  # type: ignore[attr-defined]
        for r in app.routes
        if str(getattr(r, "path", "")).startswith(PREFIX)
    )

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unsupported(path: str, request: Request) -> Response:
        await tenant_of(request)
        raise UnsupportedCall(
            f"plexrl serve does not implement {request.method} /{path}; it implements "
            f"{', '.join(implemented)}"
        )

    return app


async def _sweep(service: Service) -> None:
    """Forget expired results and end silent sessions, now and then."""
    while True:
        await asyncio.sleep(min(60.0, service.session_timeout / 4))
        try:
            await service.expire()
        except Exception:  # (the sweeper must outlive one bad pass)
            logger.exception("plexrl serve: sweeping expired results and sessions")


class ServerThread:
    """A ``plexrl serve`` in a thread of this process (tests, benchmarks, notebooks):
    uvicorn on ``host:port`` (port 0: a free one), its ``url`` once started."""

    def __init__(
        self,
        client: Any,
        keyring: KeyRing,
        models: dict[str, str],
        host: str = "127.0.0.1",
        port: int = 0,
        state_file: str | None = None,
    ) -> None:

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        app = create_app(client, keyring, models, state_file)
        self.service: Service = app.state.service
        cfg = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, name="plexrl-serve", daemon=True)

    def start(self, timeout: float = 30.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"plexrl serve did not start on {self.url} in {timeout:.0f}s")
            time.sleep(0.05)
        return self

    def run(self, coroutine: Any, timeout: float = 60.0) -> Any:
        """Run ``coroutine`` on the server's event loop (where its service lives) and return
        its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.service.loop).result(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(
    client: Any, keyring: KeyRing, models: dict[str, str], host: str, port: int, state_file: str
) -> None:  # pragma: no cover - the CLI's loop
    """Run ``plexrl serve`` in the foreground until interrupted."""
    import uvicorn

    logger.info("plexrl serve on http://%s:%d: tenants %s", host, port, keyring.tenants())
    app = create_app(client, keyring, models, state_file)
    uvicorn.run(app, host=host, port=port, log_level="info")


def models_from_config() -> dict[str, str]:
    models = config.get("serve.models") or {}
    if not isinstance(models, dict):
        raise ConfigError("plexrl.serve.models maps base model names to checkpoint directories")
    return {str(k): str(v) for k, v in models.items()}
