"""``SGLangEngine``: the :class:`InferenceEngine` contract over SGLang's native HTTP admin API.

Every call is an aiohttp request bounded by a timeout (:class:`SGLangConfig`); an engine that
does not answer in time raises :class:`EngineTimeoutError`, one that answers an error status
or ``{"success": false, ...}`` raises :class:`EngineCallError`. Nothing is retried except
``/flush_cache``, which SGLang refuses (400) while requests run and which is safe to repeat.

Routes used (see ``docs/workers.md``): ``GET /health_generate``, ``GET /model_info`` (falling
back to ``/get_model_info`` on older builds), ``GET /get_weight_version``, ``GET
/get_server_info``, ``POST /pause_generation {mode}``, ``POST /continue_generation``,
``POST /flush_cache``, ``POST /update_weights_from_disk``, ``POST /update_weight_version
{new_version, abort_all_requests: false}``, ``POST /release_memory_occupation {tags}``,
``POST /resume_memory_occupation {tags}`` and ``POST /generate``.

The release path flushes the cache first (Reef's order); a failure anywhere in a region call
leaves the adapter uncertain (see :mod:`workers.inference.engine`).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_fixed

from .engine import (EngineCallError, EngineConfigError, EngineTimeoutError, Generation,
                     InferenceEngine, WeightUpdate, check_pause_mode)


def _still_running(exc: BaseException) -> bool:
    """A ``/flush_cache`` refused with 400: requests still run, so it is worth another try."""
    return isinstance(exc, EngineCallError) and exc.status == 400


def _positive(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value <= 0:
        raise EngineConfigError(name, value, "must be a finite number of seconds > 0")


@dataclass(frozen=True)
class SGLangConfig:
    """Where the engine is and how long each kind of call may take.

    - ``url``: ``http(s)://host:port`` of the SGLang server (no path).
    - ``timeout``: bound of every control call (pause, continue, memory, version, info).
    - ``weight_update_timeout``: bound of ``update_weights_from_disk`` (it reads a checkpoint).
    - ``generate_timeout``: bound of one ``/generate`` call.
    - ``health_timeout``: default bound of a health probe.
    - ``flush_attempts`` / ``flush_interval``: how often ``flush_cache`` is tried while the
      engine answers 400 (requests running), and how long apart (Reef: 60 tries, 1 s).
    - ``api_key``: sent as ``Authorization: Bearer`` when set (SGLang's ``--api-key``).
    """

    url: str
    timeout: float = 30.0
    weight_update_timeout: float = 600.0
    generate_timeout: float = 300.0
    health_timeout: float = 30.0
    flush_attempts: int = 60
    flush_interval: float = 1.0
    #: Never in a repr (configurations are logged and put in errors).
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url) if isinstance(self.url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname \
                or parts.path not in ("", "/") or parts.query:
            raise EngineConfigError("url", self.url, "must be http(s)://host:port with no path")
        for name in ("timeout", "weight_update_timeout", "generate_timeout", "health_timeout"):
            _positive(name, getattr(self, name))
        if isinstance(self.flush_attempts, bool) or not isinstance(self.flush_attempts, int) \
                or self.flush_attempts < 1:
            raise EngineConfigError("flush_attempts", self.flush_attempts, "must be an integer >= 1")
        if isinstance(self.flush_interval, bool) or not isinstance(self.flush_interval, (int, float)) \
                or not math.isfinite(self.flush_interval) or self.flush_interval < 0:
            raise EngineConfigError("flush_interval", self.flush_interval,
                                    "must be a finite number of seconds >= 0")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")


def _detail(body: Any, text: str) -> str:
    """The engine's message from an error body (``{"error": {"message"}}``, ``{"message"}``)."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return str(error["message"])
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return text.strip()[:500] or "(empty body)"


class SGLangEngine(InferenceEngine):
    """One SGLang server (or anything speaking the same subset, e.g. the reference engine).

    ``session``: an aiohttp session to borrow (closed by its owner); without one the adapter
    opens its own and closes it in :meth:`close`. Either way each request carries the
    adapter's own bound and ``api_key``, whatever the session's defaults are.
    """

    def __init__(self, config: SGLangConfig, *, session: aiohttp.ClientSession | None = None,
                 released: tuple[str, ...] = ()) -> None:
        super().__init__(config.base, released)
        self.config = config
        self._session = session
        self._owns_session = session is None
        self._model_info_path: str | None = None

    # -- transport -------------------------------------------------------------------------

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _call(self, method: str, path: str, body: Mapping[str, Any] | None = None, *,
                    timeout: float | None = None, ok: tuple[int, ...] = (200,)) -> tuple[int, Any]:
        """One bounded request; returns ``(status, parsed JSON or text)`` for a status in ``ok``.

        Raises :class:`EngineTimeoutError` when no answer comes within ``timeout`` and
        :class:`EngineCallError` for a connection failure, another status, or a JSON body
        with ``success: false``.
        """
        self._check_usable()
        bound = self.config.timeout if timeout is None else timeout
        endpoint = f"{method} {path}"
        # Per request, not per session: a borrowed session has none of the adapter's settings.
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else None
        try:
            async with asyncio.timeout(bound):  # covers connect, send, and reading the body
                # The request's own timeout replaces the session's default (aiohttp: 300 s in
                # total), which would otherwise cut a longer bound short, e.g. a weight update.
                async with self._client().request(method, self.config.base + path,
                                                  json=None if body is None else dict(body),
                                                  headers=headers,
                                                  timeout=aiohttp.ClientTimeout(total=bound)) as resp:
                    text = await resp.text()
                    status = resp.status
                    is_json = resp.content_type == "application/json"
        except TimeoutError:
            raise EngineTimeoutError(endpoint, bound) from None
        except aiohttp.ClientError as exc:
            raise EngineCallError(endpoint, None, f"{type(exc).__name__}: {exc}") from None
        parsed: Any = text
        if is_json and text:
            try:
                parsed = json.loads(text)
            except ValueError:
                raise EngineCallError(endpoint, status, f"invalid JSON body: {text[:200]!r}") from None
        if status not in ok:
            raise EngineCallError(endpoint, status, _detail(parsed, text))
        if isinstance(parsed, dict) and parsed.get("success") is False:
            # SGLang answers some failures with 200 and success:false; they are failures all the same.
            raise EngineCallError(endpoint, status, _detail(parsed, text))
        return status, parsed

    # -- information -----------------------------------------------------------------------

    async def model_info(self) -> dict[str, Any]:
        """``/model_info`` (newer builds) or ``/get_model_info`` (older ones)."""
        paths = [self._model_info_path] if self._model_info_path else ["/model_info", "/get_model_info"]
        for i, path in enumerate(paths):
            try:
                _, body = await self._call("GET", path)
            except EngineCallError as exc:
                if exc.status == 404 and i + 1 < len(paths):
                    continue  # this build names the route the other way
                raise
            if not isinstance(body, dict):
                raise EngineCallError(f"GET {path}", 200, f"expected a JSON object, got {body!r:.200}")
            self._model_info_path = path
            return body
        raise AssertionError("unreachable: the last path either returns or raises")

    async def server_info(self) -> dict[str, Any]:
        _, body = await self._call("GET", "/get_server_info")
        if not isinstance(body, dict):
            raise EngineCallError("GET /get_server_info", 200, f"expected a JSON object, got {body!r:.200}")
        return body

    async def weight_version(self) -> str | None:
        """The ``weight_version`` of ``/model_info`` (what Reef reads as the runtime load id)."""
        version = (await self.model_info()).get("weight_version")
        return None if version is None else str(version)

    async def health(self, timeout: float | None = None) -> bool:
        """``GET /health_generate`` answered 200 within ``timeout`` (default ``health_timeout``)."""
        bound = self.config.health_timeout if timeout is None else timeout
        _positive("timeout", bound)
        try:
            await self._call("GET", "/health_generate", timeout=bound)
        except EngineCallError:
            return False
        return True

    # -- generation control ------------------------------------------------------------------

    async def pause_generation(self, mode: str = "retract") -> None:
        await self._call("POST", "/pause_generation", {"mode": check_pause_mode(mode)})

    async def continue_generation(self) -> None:
        await self._call("POST", "/continue_generation", {})

    async def flush_cache(self, attempts: int | None = None) -> None:
        """``POST /flush_cache``, repeated while it answers 400 (requests still running)."""
        tries = self.config.flush_attempts if attempts is None else attempts
        if isinstance(tries, bool) or not isinstance(tries, int) or tries < 1:
            raise EngineConfigError("attempts", attempts, "must be an integer >= 1")
        retrying = AsyncRetrying(stop=stop_after_attempt(tries), wait=wait_fixed(self.config.flush_interval),
                                 retry=retry_if_exception(_still_running), sleep=asyncio.sleep, reraise=True)
        await retrying(self._call, "POST", "/flush_cache", {})

    # -- weights ---------------------------------------------------------------------------

    async def update_weights_from_disk(self, model_path: str, weight_version: str, *,
                                       flush_cache: bool = True,
                                       abort_all_requests: bool = False) -> WeightUpdate:
        """``POST /update_weights_from_disk``; the engine serves ``weight_version`` on success.

        A refusal (400, ``success: false``) raises :class:`EngineCallError`; SGLang keeps its
        previous weights then. A timeout leaves the outcome open: read :meth:`weight_version`.
        """
        if not isinstance(model_path, str) or not model_path:
            raise EngineConfigError("model_path", model_path, "must be a non-empty path")
        if not isinstance(weight_version, str) or not weight_version:
            raise EngineConfigError("weight_version", weight_version, "must be a non-empty string")
        _, body = await self._call("POST", "/update_weights_from_disk", {
            "model_path": model_path, "weight_version": weight_version,
            "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
        }, timeout=self.config.weight_update_timeout)
        if not isinstance(body, dict) or body.get("success") is not True:
            raise EngineCallError("POST /update_weights_from_disk", 200,
                                  f"expected success: true, got {body!r:.200}")
        return WeightUpdate(str(body.get("message", "")), int(body.get("num_paused_requests") or 0))

    async def set_weight_version(self, weight_version: str) -> None:
        if not isinstance(weight_version, str) or not weight_version:
            raise EngineConfigError("weight_version", weight_version, "must be a non-empty string")
        # abort_all_requests defaults to true in recent SGLang; a relabel must abort nothing.
        await self._call("POST", "/update_weight_version",
                         {"new_version": weight_version, "abort_all_requests": False})

    # -- memory ----------------------------------------------------------------------------

    async def _release_regions(self, regions: tuple[str, ...]) -> None:
        await self.flush_cache()  # Reef's order: nothing cached may outlive the memory under it
        await self._call("POST", "/release_memory_occupation", {"tags": list(regions)})

    async def _resume_regions(self, regions: tuple[str, ...]) -> None:
        await self._call("POST", "/resume_memory_occupation", {"tags": list(regions)})

    # -- generation ------------------------------------------------------------------------

    async def generate(self, text: str, max_new_tokens: int, *,
                       sampling_params: Mapping[str, Any] | None = None) -> Generation:
        """``POST /generate {text, sampling_params}`` (greedy unless ``sampling_params`` say else)."""
        if not isinstance(text, str):
            raise EngineConfigError("text", text, "must be a string")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise EngineConfigError("max_new_tokens", max_new_tokens, "must be an integer >= 0")
        params = {"temperature": 0.0, **(sampling_params or {}), "max_new_tokens": max_new_tokens}
        _, body = await self._call("POST", "/generate", {"text": text, "sampling_params": params},
                                   timeout=self.config.generate_timeout)
        if not isinstance(body, dict) or not isinstance(body.get("text"), str):
            raise EngineCallError("POST /generate", 200, f"expected {{text, meta_info}}, got {body!r:.200}")
        meta = body.get("meta_info") if isinstance(body.get("meta_info"), dict) else {}
        assert isinstance(meta, dict)
        reason = meta.get("finish_reason")
        version = meta.get("weight_version")
        return Generation(text=body["text"], output_ids=list(body.get("output_ids") or []),
                          finish_reason=reason if isinstance(reason, dict) else {},
                          weight_version=None if version is None else str(version), meta_info=meta)

    async def close(self) -> None:
        if self._owns_session and self._session is not None:
            await self._session.close()
        self._session = None


__all__ = ["SGLangConfig", "SGLangEngine"]
