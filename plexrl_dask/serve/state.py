"""What ``plexrl serve`` keeps across its own restarts (``plexrl.serve.state-file``).

Four things outlive the server process, so they are written to a file (JSON, mode 0600,
replaced whole on every change, so a reader never sees half of it):

- **its tenants' job secrets**, per scheduler: a tenant is a PlexRL job, and the scheduler lets
  a job be acted for only by the driver that registered it or one presenting its secret; a
  restarted server that had forgotten them could serve none of its tenants again;
- **saved checkpoints** (``tinker://`` paths to what ``save_state`` returned): the weights are in
  the cluster's state store, and their paths are how a tenant asks for them;
- **training runs** (base model, ``user_metadata``): what ``training_runs/{id}`` answers for a
  checkpoint's run;
- **the server's own job's name** (its adapter banks' job; its secret is with the tenants').

Sessions, models and samplers are not kept: their clients are gone with the old server's
connections. On its first use of a tenant's job, a restarted server undeploys what that job
still had (the last run's models and samplers), so nothing of it holds the pool.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from plexrl_dask.errors import ConfigError


class ServeState:
    """The state file at ``path`` (None: nothing is kept, as for a server in a test)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else Path(path)
        self.data: dict[str, dict[str, Any]] = {
            "jobs": {},
            "checkpoints": {},
            "runs": {},
            "server": {},
        }
        if self.path is not None and self.path.exists():
            try:
                loaded = json.loads(self.path.read_text())
            except (OSError, ValueError) as e:
                raise ConfigError(f"cannot read plexrl serve's state file {self.path}: {e}") from e
            if not isinstance(loaded, dict):
                raise ConfigError(f"plexrl serve's state file {self.path} is not a JSON object")
            for table in self.data:
                self.data[table].update(loaded.get(table) or {})

    def server_job(self) -> str:
        """The server's own job (its adapter banks'): named once per state file, so that a
        restarted server finds it again and two servers on one cluster never share one."""
        job = self.data["server"].get("job")
        if not isinstance(job, str):
            job = f"plexrl-serve-{uuid.uuid4().hex[:12]}"
            self.put("server", "job", job)
        return job

    def secret(self, scheduler: str, job: str) -> str | None:
        return self.data["jobs"].get(f"{scheduler}|{job}")

    def set_secret(self, scheduler: str, job: str, secret: str) -> None:
        self.put("jobs", f"{scheduler}|{job}", secret)

    def table(self, name: str) -> dict[str, Any]:
        return self.data[name]

    def put(self, table: str, key: str, value: Any) -> None:
        self.data[table][key] = value
        self._write()

    def delete(self, table: str, key: str) -> None:
        if self.data[table].pop(key, None) is not None:
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plexrl-serve-")
        with os.fdopen(fd, "w") as f:
            json.dump(self.data, f)
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
