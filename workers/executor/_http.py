"""``http``: ranks that are services, each a ``python -m workers.executor.serve`` process at a URL.

The processes are not this executor's: the deployment's stack (or an operator) starts, watches and
rebuilds them, so ``shutdown`` closes the executor and leaves them running (they are borrowed).
Options (``ExecutorConfig.options``):

- ``urls``: one base URL per rank, in rank order (required);
- ``token_env``: the environment variable holding the services' bearer token (optional; read when
  the executor is built, never logged).

Launch waits up to ``launch_timeout_s`` for every rank's ``GET /health`` and checks that it serves
the configured worker class. Each rank's calls go one at a time, in submission order, on a thread
of their own; a worker's exception comes back as :class:`ServedWorkerError` carrying the remote
classes (``remote_mro``) and fields. A rank that cannot be reached (connection refused or reset, a
reply cut off) is the executor's terminal failure, as a dead process is on ``mp``: every pending
wait fails with ``ExecutorFailedError`` and the owner builds a new executor when it wants one.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

from workers.executor._base import SubmittingExecutor
from workers.executor._failure import SHUT_DOWN_MESSAGE
from workers.executor._future import ExecutorFuture
from workers.executor._mp_child import RemoteWorkerError
from workers.executor._spec import ExecutorConfig, ExecutorConfigError, ExecutorLaunchError

__all__ = ["HttpExecutor", "ServedWorkerError", "check_http_options"]

#: The fields a served typed error carries back (workers.executor.serve sends these only).
FIELDS = ("field", "value", "rule", "path")
#: Failures that mean the rank's process is gone (or the path to it is): terminal for the executor.
_UNREACHABLE = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead, TimeoutError)


class ServedWorkerError(RemoteWorkerError):
    """A served worker's exception: its type name, words and remote traceback, plus ``remote_mro``
    (every class of it as ``module.Qualname``) and ``fields`` (a typed error's field, value, rule...)."""

    def __init__(self, type_name: str, message: str, remote_traceback: str,
                 remote_mro: tuple[str, ...] = (), fields: dict[str, Any] | None = None) -> None:
        super().__init__(type_name, message, remote_traceback)
        self.remote_mro = remote_mro
        # Only the typed errors' own field names become attributes (a reply names any keys it likes).
        self.fields = {k: v for k, v in (fields or {}).items() if k in FIELDS}
        for key, value in self.fields.items():
            setattr(self, key, value)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.type_name, str(self).partition(": ")[2], self.remote_traceback,
                             self.remote_mro, self.fields))


def check_http_options(options: Mapping[str, Any], ranks: int, *, where: str = "ExecutorConfig",
                       gpus_per_worker: float = 0, node_id: str | None = None) -> tuple[list[str], str | None]:
    """The http backend's rules, in one place for the executor and the configuration: the ranks'
    URLs (one http(s) URL per rank, a trailing ``/`` dropped) and the token's variable, or
    ``ExecutorConfigError`` naming the option under ``where`` (``training.executor`` reads
    ``options.urls[1]``)."""
    unknown = sorted(set(options) - {"urls", "token_env"})
    if unknown:
        raise ExecutorConfigError(f"{where}.options", dict(options),
                                  f"the http backend knows only 'urls' and 'token_env', not {unknown}")
    urls = options.get("urls")
    if not isinstance(urls, (list, tuple)) or len(urls) != ranks or not urls:
        counted = f"{ranks} rank{'' if ranks == 1 else 's'}"
        raise ExecutorConfigError(f"{where}.options.urls", urls, f"one http(s) URL per rank ({counted})")
    for rank, url in enumerate(urls):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ExecutorConfigError(f"{where}.options.urls[{rank}]", url, "must be an http(s) URL")
    token_env = options.get("token_env")
    if token_env is not None and (not isinstance(token_env, str) or not token_env):
        raise ExecutorConfigError(f"{where}.options.token_env", token_env, "must name a variable")
    if node_id is not None or gpus_per_worker:
        raise ExecutorConfigError(where, "node_id/gpus_per_worker",
                                  "the http backend places nothing: the services own their devices")
    return [u.rstrip("/") for u in urls], token_env


class HttpExecutor(SubmittingExecutor):
    """Ranks served over HTTP (see the module docstring)."""

    backend = "http"

    def _init_executor(self) -> None:
        self._urls, token_env = check_http_options(self.config.options, len(self.config.workers),
                                                   gpus_per_worker=self.config.gpus_per_worker,
                                                   node_id=self.config.node_id)
        self._token: str | None = None
        if token_env is not None:
            self._token = os.environ.get(token_env) or None
            if self._token is None:
                raise ExecutorConfigError("ExecutorConfig.options.token_env", token_env, "is not set in the environment")
        deadline = time.monotonic() + self.config.launch_timeout_s
        for rank, (url, spec) in enumerate(zip(self._urls, self.config.workers)):
            served = self._wait_healthy(rank, url, deadline)
            if served.get("worker") != spec.name:
                raise ExecutorLaunchError(self.backend, rank, f"{url} serves {served.get('worker')!r}, "
                                                              f"not the configured {spec.name!r}")
        self._pools = [concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tidelog-http-rank{r}")
                       for r in range(len(self._urls))]

    def _wait_healthy(self, rank: int, url: str, deadline: float) -> dict[str, Any]:
        last = "no answer"
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as resp:
                    body: dict[str, Any] = json.loads(resp.read())
                    return body
            except (OSError, ValueError, http.client.HTTPException) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ExecutorLaunchError(self.backend, rank, f"{url}/health did not answer within "
                                                              f"{self.config.launch_timeout_s:g} s ({last})")
            time.sleep(0.1)

    @property
    def num_workers(self) -> int:
        return len(self._urls)

    def _post(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(self._urls[rank] + "/rpc", method="POST", headers=headers,
                                         data=json.dumps({"method": method, "args": list(args), "kwargs": kwargs}).encode())
        try:
            with urllib.request.urlopen(request) as resp:  # no socket timeout: a call's wait is the caller's
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            said = exc.read().decode(errors="replace")[:500]
            raise RuntimeError(f"http rank {rank} refused {method!r}: HTTP {exc.code} {said}") from None
        error = body.get("error")
        if error is not None:
            raise ServedWorkerError(str(error.get("type")), str(error.get("message")), str(error.get("traceback")),
                                    tuple(error.get("mro") or ()), error.get("fields") or {})
        return body.get("value")

    def _submit(self, rank: int, method: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                timeout: float | None) -> ExecutorFuture[Any]:
        future: ExecutorFuture[Any] = ExecutorFuture(f"http rank {rank} {method!r}")
        self._track(future)

        def call() -> None:
            try:
                value = self._post(rank, method, args, kwargs)
            except urllib.error.URLError as exc:
                self._unreachable(rank, exc.reason)
            except _UNREACHABLE as exc:
                self._unreachable(rank, exc)
            except BaseException as exc:  # the worker's exception (or a refusal) goes to the caller
                future.set_exception(exc)
            else:
                future.set_result(value)

        try:
            self._pools[rank].submit(call)
        except RuntimeError:
            future.set_exception(RuntimeError(SHUT_DOWN_MESSAGE))
        return future

    def _unreachable(self, rank: int, why: object) -> None:
        # The pending futures (this call's among them) fail with the executor's failure.
        self._fail(f"rank {rank} at {self._urls[rank]} cannot be reached ({why})", rank)

    def check_health(self, timeout: float | None = None) -> None:
        self._failure_state.check()
        for rank, url in enumerate(self._urls):
            try:
                with urllib.request.urlopen(url + "/health", timeout=timeout or 5):
                    pass
            except urllib.error.URLError as exc:
                self._unreachable(rank, exc.reason)
            except _UNREACHABLE as exc:
                self._unreachable(rank, exc)
        self._failure_state.check()

    def shutdown(self) -> None:
        """Close; the served processes are the stack's, not this executor's, and keep running."""
        self._failure_state.close()
        for pool in getattr(self, "_pools", []):
            pool.shutdown(wait=False)
