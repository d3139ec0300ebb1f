"""Which model a request goes to: the default `--model`, or one of `--model-dir`'s by name.

`ModelRouting` holds the folder's catalog (models/catalog.py) and a `RemoteModels` (engine/remote_models.py): the
`ModelSet` itself (engine/model_set.py: the resident engines on one device loop) lives in the engine's replica
process, and this process asks it over the pipe. `target(name, seconds)` answers a request's `model` with the engine
client to submit to and that model's `ModelInfo` (what the request is validated against), loading the model first
when it is not resident (the request waits, within its timeout); the hold it returns keeps the model resident until
the request is submitted. Bad names are a 400 naming `model`, unknown ones (or removed since they were resolved) a
404, a model that fails to load a 400 with its reason; the others keep serving. A `--model PATH` inside the folder is
the default under its `--model` name only (its folder name resolves to it). `listing()` is `GET /v1/models`: every
model with its family, native size, whether it is resident, its weights-and-graphs bytes, a split diffusion model's
text encoder and VAE files (`files`; models/split_files.py), AUTOMATIC1111's short hash
(`FileHashes`, models/file_hashes.py: hashed once per file version on a background thread and kept across starts;
null until known, never waited for) and its `error`, with `error_kind`: "file" (the file cannot be served as it is)
or "load" (its last load failed; the next request for it tries again). Every
message a client gets names files relative to the folder (`shown`); whole paths go to the server's log only.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from ..engine.client import EngineClient
from ..engine.remote_models import ModelsBackend, RemoteResident
from ..errors import ModelLoadError, relative_paths
from ..models.catalog import ModelDir, ModelEntry, ModelNameError, ModelNotFound, model_path
from ..models.clip_vocab import default_cache_root
from ..models.file_hashes import FileHashes
from ..request import EngineClosed, ModelInfo
from ..api.protocol import APIError

logger = logging.getLogger("diffgraph.server")


@dataclass
class Target:
    client: EngineClient
    info: ModelInfo
    hold: RemoteResident | None  # released once the request is submitted

    def release(self, routing: "ModelRouting") -> None:
        if self.hold is not None:
            routing.models.release(self.hold)
            self.hold = None


class ModelRouting:
    def __init__(self, root: str, default: str, models: ModelsBackend, hashes: FileHashes | None = None):
        self.catalog = ModelDir(root)
        self._roots = (root, self.catalog.root)  # as given and its real path: what messages are relative to
        self.default = default
        self._default_path = model_path(default)  # `--model PATH` inside the folder: its entry is the default
        self.models = models  # the set, in the engine's processes (replica processes or Ray engine replicas)
        self.hashes = hashes or FileHashes(default_cache_root())  # A1111's hashes, hashed in the background

    async def resolve(self, name: str) -> str:
        """The folder's name of the model `name` names (APIError: 404 for an unknown one, 400 for an unusable one)."""
        try:
            entry = await asyncio.to_thread(self.catalog.resolve, name)
        except ModelNotFound as e:
            raise APIError(404, f"{self.shown(e)} (or the default, {self.default!r}; GET /v1/models lists them)",
                           param="model", code="model_not_found") from None
        except ModelNameError as e:
            raise APIError(400, self.shown(e), param="model", code="model_unusable") from None
        return self.default if self._is_default(entry) else entry.name

    def shown(self, error: Exception | str | None) -> str | None:
        """An error as a client sees it: paths under the folder relative to it (the log keeps them whole)."""
        return None if error is None else relative_paths(str(error), *self._roots)

    def _is_default(self, entry: ModelEntry) -> bool:
        """Whether a folder entry is the default model: one model, one name (and one engine)."""
        return entry.name == self.default or entry.path == self._default_path

    async def target(self, name: str | None, seconds: float, default: Target) -> Target:
        if name is None or name == self.default:
            return default
        resolved = await self.resolve(name)
        if resolved == self.default:  # the default's file by its folder name
            return default
        try:
            resident = await self._acquire(resolved, max(0.0, seconds))
        except TimeoutError:
            raise APIError(504, f"model {name!r} is still loading after the request timeout; retry in a while "
                                "(GET /v1/models shows it resident when it is ready)", code="model_loading") from None
        except ModelLoadError as e:
            await self.resolve(name)  # removed or renamed since it was resolved: the 404 of a name not listed
            raise APIError(400, self.shown(e), param="model", code="model_unusable") from None
        except EngineClosed as e:  # the engine process went (or restarts) while the model loaded: retryable
            raise APIError(503, f"{e}", code="engine_unavailable") from None
        return Target(resident.client, resident.client.info, resident)

    async def _acquire(self, name: str, seconds: float) -> RemoteResident:
        """`models.acquire` on a thread of its own: a load takes minutes, and requests waiting for it must not take
        the default executor's few threads (every other request's listings, reads and encodes need them). A hold
        acquired for a request that is gone meanwhile (cancelled) is released, else its model stays held for good."""
        done: Future = Future()

        def work() -> None:
            try:
                done.set_result(self.models.acquire(name, seconds))
            except BaseException as e:
                done.set_exception(e)
        threading.Thread(target=work, name="diffgraph-acquire", daemon=True).start()
        try:
            return await asyncio.shield(asyncio.wrap_future(done))
        except asyncio.CancelledError:
            done.add_done_callback(lambda f: f.exception() is None and self.models.release(f.result()))
            raise

    def family(self, name: str) -> str | None:
        """The family of a folder model (from its files, without loading it); None for the default."""
        return None if name == self.default else self.catalog.resolve(name).family

    def listing(self, created: int) -> list[dict[str, Any]]:
        resident = {r.name: r for r in self.models.resident()}
        loading = set(self.models.loading())
        entries = self.catalog.listing()
        failed = self.models.errors  # once: a remote backend asks every replica
        out = [self._card(self.default, created, resident, loading, family=None, size=None, error=None)]
        for e in entries:
            if self._is_default(e):
                continue
            # "file": the entry cannot be served as it is (listed anew when the file changes); "load": its last load
            # failed, and the next request for it tries again (so it stays on offer: A1111's titles list it)
            error, error_kind = (e.error, "file") if e.error else (failed.get(e.name), "load")
            card = self._card(e.name, created, resident, loading, e.family, e.native_size, self.shown(error),
                              e.path if e.form == "file" and not e.error else None, e.kind, error_kind)
            # a split diffusion model's companion files, named relative to the folder (null for a whole model)
            card["files"] = {role: self.shown(p) for role, p in e.split.files().items()} if e.split else None
            out.append(card)
        return out

    def _card(self, name: str, created: int, resident: dict[str, RemoteResident], loading: set[str], family: str | None,
              size: int | None, error: str | None, file: str | None = None, kind: str | None = None,
              error_kind: str | None = None) -> dict:
        r = resident.get(name)
        if r is not None:
            family, size = r.client.info.family, r.client.info.native_size
        return {"id": name, "object": "model", "created": created, "owned_by": "diffgraph", "family": family,
                "native_size": size, "capabilities": list(r.client.info.capabilities) if r else None, "kind": kind, "resident": r is not None, "loading": name in loading,
                "memory_bytes": r.memory_bytes if r else None, "default": name == self.default,
                "hash": self.hashes.short(file) if file else None, "files": None, "error": error,
                "error_kind": error_kind if error else None}

    def close(self) -> None:
        self.models.close()
