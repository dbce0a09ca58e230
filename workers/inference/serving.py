"""The reference engine's serving state: the policy, its memory regions, pausing and generation.

:class:`ReferenceEngineState` is what ``python -m workers.inference.reference`` serves over
HTTP (:mod:`workers.inference.reference`). It runs on one asyncio loop, so its state changes
between ``await`` points only. It models the parts of an SGLang server that the adapter drives:

- **Regions.** ``weights`` is the :class:`~workers.policy.Policy` itself, a Hugging Face causal LM
  (released, its tensors move to a host-side backup and the model is dropped; resumed, it is
  rebuilt from the backup). ``kv_cache`` is the prefix cache: prompts seen recently, reported as
  ``cached_tokens``. ``cuda_graph`` is the table of captured forward passes (next-token logits by
  token sequence, up to :data:`CAPTURED` of them), replayed by a decoding step that meets a
  sequence again and dropped whenever the weights change. A request runs only while every region
  is resident; otherwise it waits.
- **Pause.** Requests that arrive while paused wait. In-flight requests, at their next token:
  ``abort`` finishes them (and every waiting one) with ``finish_reason {"type": "abort"}``;
  ``retract`` moves them back to waiting, so the cache can be flushed and memory released;
  ``in_place`` keeps them running where they are (flush and release then fail with 400).
- **Decoding.** Each token is predicted from the whole sequence so far (prompt and output), with
  ``transformers`` on the CPU. Greedy by default; with a temperature > 0, each token is drawn from
  the softmax of the logits over the temperature, by the request's own generator (seeded by
  ``sampling_seed``, so a request sent again draws the same tokens on the same weights). Greedy
  tokens are what ``from_pretrained(...).generate(do_sample=False)`` gives for the same directory.
- **Weights.** :meth:`update_weights` loads a weights directory with
  :func:`~workers.policy.load_weights`; a bad directory is refused and the old weights stay.
  Unpaused, the update waits for running requests to finish and holds new ones back (SGLang's
  writer lock); paused, it goes ahead and reports how many requests it held.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policy import DIM, VOCAB, Policy, WeightsError, decode, encode, load_weights
from .engine import PAUSE_MODES, REGIONS

PREFIX_CACHE_SIZE = 1024
#: Most forward passes the ``cuda_graph`` region keeps (see the module docs).
CAPTURED = 4096
HEALTH_RID_PREFIX = "HEALTH_CHECK_"


class ServingError(Exception):
    """A request the engine refuses: answered with ``status`` and ``message``.

    ``success_body``: answer ``{"success": false, "message"}`` (the weight routes) rather
    than ``{"error": {"message"}}``.
    """

    def __init__(self, status: int, message: str, *, success_body: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.success_body = status, message, success_body


@dataclass
class Request:
    """One generation request and where it is: ``waiting``, ``running`` or ``retracted``."""

    rid: str
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    state: str = "waiting"
    aborted: bool = False
    cached_tokens: int = 0
    created: float = field(default_factory=time.monotonic)
    #: 0: greedy; > 0: sampled from ``softmax(logits / temperature)`` with ``generator``.
    temperature: float = 0.0
    generator: torch.Generator | None = None


class ReferenceEngineState:
    """The serving core; see the module docstring for its semantics."""

    def __init__(self, model: Policy, weight_version: str, model_path: str) -> None:
        self.model: Policy | None = model
        self.weight_version = weight_version
        self.model_path = model_path
        self.vocab, self.dim = model.vocab, model.dim
        #: Where the model's tensors live while resident (``cpu`` or a CUDA device).
        self.device = str(next(model.parameters()).device)
        self.resident = {region: True for region in REGIONS}
        self.paused = False
        self.pause_mode: str | None = None
        self.updating = False
        self.forward_sleep: float | None = None
        self.requests: dict[str, Request] = {}
        self._backup: dict[str, torch.Tensor] | None = None
        self._graph: OrderedDict[tuple[int, ...], torch.Tensor] | None = None
        self._prefix_cache: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self._changed = asyncio.Condition()
        self._rids = itertools.count()

    # -- bookkeeping -----------------------------------------------------------------------

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _can_step(self) -> bool:
        """Whether a running request may decode its next token."""
        return not self.paused and all(self.resident.values())

    def _can_start(self) -> bool:
        """Whether a new request may start (a weight update in progress holds it back)."""
        return self._can_step() and not self.updating

    def running(self) -> list[Request]:
        """Requests holding decode state now (``in_place``-paused ones included)."""
        return [r for r in self.requests.values() if r.state == "running"]

    def stats(self) -> dict[str, Any]:
        waiting = [r for r in self.requests.values() if r.state != "running"]
        return {"num_running_reqs": len(self.running()), "num_waiting_reqs": len(waiting),
                "paused": self.paused, "pause_mode": self.pause_mode,
                "memory": {r: "resident" if up else "released" for r, up in self.resident.items()},
                "forward_sleep_time": self.forward_sleep,
                "cached_prompts": len(self._prefix_cache)}

    def _logits(self, sequence: list[int]) -> torch.Tensor:
        """The next-token logits after ``sequence``: replayed from the captured passes, else run now."""
        if self._graph is None:
            self._graph = OrderedDict()
        key = tuple(sequence)
        found = self._graph.get(key)
        if found is None:
            assert self.model is not None, "generation runs only with the weights resident"
            found = self.model.next_logits(sequence)
            self._graph[key] = found
            while len(self._graph) > CAPTURED:
                self._graph.popitem(last=False)
        else:
            self._graph.move_to_end(key)
        return found

    def _next_token(self, req: Request) -> int:
        logits = self._logits(req.prompt + req.output)
        if req.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits / req.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=req.generator).item())

    # -- generation ------------------------------------------------------------------------

    async def _admit(self, req: Request, *, starting: bool) -> None:
        ready = self._can_start if starting else self._can_step
        async with self._changed:
            await self._changed.wait_for(lambda: req.aborted or ready())

    async def generate(self, prompt_text: str | None, input_ids: list[int] | None,
                       max_new_tokens: int, rid: str | None = None, *, temperature: float = 0.0,
                       seed: int | None = None) -> dict[str, Any]:
        """Greedy generation (``temperature`` 0), else sampled — reproducibly when ``seed`` is given:
        the same seed, prompt and weights draw the same tokens. Returns SGLang's ``{text, output_ids,
        meta_info}``."""
        prompt = list(input_ids) if input_ids is not None else encode(prompt_text or "")
        if not prompt:
            raise ServingError(400, "the prompt must hold at least one token")
        if any(not 0 <= t < self.vocab for t in prompt):
            raise ServingError(400, f"input_ids must lie in [0, {self.vocab})")
        rid = rid or f"{next(self._rids):08x}"
        if rid in self.requests:
            raise ServingError(400, f"rid {rid!r} is already in flight")
        req = Request(rid, prompt, max_new_tokens, temperature=temperature)
        if temperature > 0:
            req.generator = torch.Generator()
            if seed is None:
                req.generator.seed()
            else:
                req.generator.manual_seed(seed)
        self.requests[rid] = req
        try:
            await self._run(req)
        finally:
            del self.requests[rid]
            await self._notify()  # a writer or a flush may be waiting for the running set to drain
        if req.aborted:
            reason: dict[str, Any] = {"type": "abort", "message": "aborted by pause_generation"}
        else:
            reason = {"type": "length", "length": len(req.output)}
        return {"text": decode(req.output), "output_ids": list(req.output), "meta_info": {
            "id": rid, "finish_reason": reason, "prompt_tokens": len(prompt),
            "completion_tokens": len(req.output), "cached_tokens": req.cached_tokens,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - req.created}}

    async def _run(self, req: Request) -> None:
        await self._admit(req, starting=True)
        if req.aborted:
            return
        req.state = "running"
        key = tuple(req.prompt)
        req.cached_tokens = len(key) if key in self._prefix_cache else 0
        self._prefix_cache[key] = None
        self._prefix_cache.move_to_end(key)
        while len(self._prefix_cache) > PREFIX_CACHE_SIZE:
            self._prefix_cache.popitem(last=False)
        while len(req.output) < req.max_new_tokens:
            if req.aborted:
                return
            if not self._can_step():  # a pause reached this request's token boundary
                if self.paused and self.pause_mode == "retract":
                    req.state = "retracted"  # its decode state is dropped; it recomputes on continue
                    await self._notify()
                await self._admit(req, starting=False)
                if req.aborted:
                    return
                req.state = "running"
                continue
            if self.forward_sleep:
                await asyncio.sleep(self.forward_sleep)  # the simulated forward time
                if req.aborted or not self._can_step():
                    continue  # a pause came during the step: it takes effect before the token
            req.output.append(self._next_token(req))
            if len(req.output) % 32 == 0:
                await asyncio.sleep(0)  # let other requests and admin calls in

    # -- pause -----------------------------------------------------------------------------

    async def pause(self, mode: str) -> None:
        if mode not in PAUSE_MODES:
            raise ServingError(400, f"mode: {mode!r} must be one of {PAUSE_MODES}")
        self.paused, self.pause_mode = True, mode
        if mode == "abort":
            await self.abort_all()
        await self._notify()

    async def abort_all(self) -> None:
        """Finish every request in flight or waiting with ``finish_reason {"type": "abort"}``."""
        for req in self.requests.values():
            req.aborted = True
        await self._notify()

    async def resume_generation(self) -> None:
        self.paused, self.pause_mode = False, None
        await self._notify()

    # -- cache and memory ------------------------------------------------------------------

    def flush_cache(self) -> None:
        if self.running():
            raise ServingError(400, f"{len(self.running())} requests are running")
        self._prefix_cache.clear()

    async def release(self, tags: list[str] | None) -> None:
        regions = self._regions(tags)
        if self.running():
            raise ServingError(400, f"cannot release memory while {len(self.running())} requests run")
        for region in regions:
            if not self.resident[region]:
                continue  # already released: nothing to do, like a repeated SGLang release
            if region == "weights":
                assert self.model is not None
                # A host-side copy: the device memory is what a release gives back.
                self._backup = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
                self.model = None
            elif region == "kv_cache":
                self._prefix_cache.clear()
            else:
                self._graph = None
            self.resident[region] = False
        await self._notify()

    async def resume(self, tags: list[str] | None) -> None:
        for region in self._regions(tags):
            if self.resident[region]:
                continue
            if region == "weights":
                assert self._backup is not None
                model = Policy(self.vocab, self.dim)
                model.load_state_dict(self._backup)
                model.to(self.device)
                self.model, self._backup, self._graph = model, None, None
            self.resident[region] = True
        await self._notify()

    @staticmethod
    def _regions(tags: list[str] | None) -> list[str]:
        if tags is None:
            return list(REGIONS)
        unknown = [t for t in tags if t not in REGIONS]
        if unknown:
            raise ServingError(400, f"tags: {unknown} are not regions; the regions are {list(REGIONS)}")
        return list(tags)

    # -- weights ---------------------------------------------------------------------------

    async def update_weights(self, model_path: str, weight_version: str | None, flush: bool,
                             abort_all: bool) -> dict[str, Any]:
        if not self.resident["weights"]:
            raise ServingError(400, "the weights are released; resume them before an update",
                               success_body=True)
        try:
            state, meta = await asyncio.to_thread(load_weights, model_path)
        except WeightsError as exc:
            raise ServingError(400, f"failed to load weights from {model_path}: {exc}",
                               success_body=True) from None
        if (int(meta.get("vocab", VOCAB)), int(meta.get("dim", DIM))) != (self.vocab, self.dim):
            raise ServingError(400, f"{model_path}: vocab/dim {meta.get('vocab')}/{meta.get('dim')} "
                               f"do not match the served {self.vocab}/{self.dim}", success_body=True)
        if abort_all:
            await self.abort_all()
        held = 0
        if self.paused:
            held = sum(1 for r in self.requests.values() if not r.aborted)
        else:
            self.updating = True  # new requests and token steps wait for the swap
            try:
                async with self._changed:
                    await self._changed.wait_for(lambda: not self.running())
            except BaseException:
                self.updating = False
                await self._notify()
                raise
        try:
            assert self.model is not None
            self.model.load_state_dict(state)
            self._graph = None  # recaptured from the new weights at the next step
            if flush:
                self._prefix_cache.clear()
            self.model_path = model_path
            if weight_version is not None:
                self.weight_version = weight_version
        finally:
            self.updating = False
            await self._notify()
        message = "Succeeded to update model weights."
        if weight_version is not None:
            message += f" Weight version updated to {weight_version}."
        return {"success": True, "message": message, "num_paused_requests": held}

    async def health_generate(self, timeout: float) -> bool:
        """One 1-token request within ``timeout`` (it waits like any other while paused)."""
        try:
            async with asyncio.timeout(timeout):
                await self.generate(None, [0], 1, rid=f"{HEALTH_RID_PREFIX}{next(self._rids)}")
        except TimeoutError:
            return False
        return True


__all__ = ["HEALTH_RID_PREFIX", "ReferenceEngineState", "Request", "ServingError"]
