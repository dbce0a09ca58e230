"""What the RL demo (``engine/demos/training.py``) adds to the reference servers: the engine's seeded
sampling, the model participant generating its actions on an engine (``--engine``; its counts per
weight version kept across a restart), and the
resources server's learnable ``--task`` rule. Without these options nothing changes (the other
tests of this package run the defaults)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.reference_procs import ParticipantClient, Procs
from tests.workers.inference.engines import EngineProc
from workers.inference.reference import GenerateBody
from workers.inference.serving import ReferenceEngineState
from workers.policy import Policy, encode
from workers.reference.model import engine_prompt, sampling_seed
from workers.reference.resources import check_ok, checker


def test_task_rules() -> None:
    assert checker("hex") is check_ok
    has_s, two_s = checker("letter:s"), checker("letter:s:2")
    assert has_s("kiss") and has_s("S b") and not has_s("abc d")
    assert two_s("kiss") and not two_s("ask")
    for bad in ("letter", "letter:", "letter:ab", "letter:1", "letter:s:x", "letter:s:0", "vowels"):
        with pytest.raises(SystemExit, match="--task"):
            checker(bad)


async def test_the_engine_samples_reproducibly_and_stays_greedy_by_default() -> None:
    assert GenerateBody.model_validate({"text": "a"}).sampling_params.temperature is None
    state = ReferenceEngineState(Policy(seed=0), "initial", "seed-0")
    greedy = Policy(seed=0).generate(encode("round 1"), 8)
    assert (await state.generate("round 1", None, 8))["output_ids"] == greedy
    assert (await state.generate("round 1", None, 8, temperature=0.0, seed=3))["output_ids"] == greedy
    drawn = [(await state.generate("round 1", None, 8, temperature=1.0, seed=s))["output_ids"] for s in (7, 7, 8)]
    assert drawn[0] == drawn[1]  # the same seed, prompt and weights: the same tokens
    assert drawn[0] != drawn[2] and drawn[0] != greedy


@pytest.mark.slow
async def test_the_model_generates_its_actions_on_the_engine(procs: Procs, controller: ParticipantClient,
                                                             tmp_path: Path) -> None:
    engine = EngineProc(["--port", "0"], tmp_path / "engine.log").start()
    try:
        model = procs.start("model", tmp_path / "model", "--engine", engine.url)
        resources = procs.start("resources", tmp_path / "resources", "--task", "letter:s")
        messages = [{"role": "user", "content": "round 0 task 1"}]
        path = "/ng-rollout/r1/v1/chat/completions"
        status, reply = await controller.post(model.url, path, {"messages": messages})
        assert status == 200, reply
        action = reply["choices"][0]["message"]["content"]
        assert len(action) == 6 and set(action) <= set("abcdefghijklmnopqrstuvwxyz ")
        # What the engine samples for the prompt and seed the model derives from the conversation.
        status, direct = await controller.post(engine.url, "/generate", {
            "text": engine_prompt(messages), "sampling_params": {
                "max_new_tokens": 6, "temperature": 1.0, "sampling_seed": sampling_seed(messages)}})
        assert status == 200 and direct["text"] == action
        status, again = await controller.post(model.url, "/ng-rollout/r2/v1/chat/completions", {"messages": messages})
        assert status == 200 and again["choices"][0]["message"]["content"] == action
        assert (await controller.status(model.url))["generated_on"] == {"initial": 2}
        # The counts outlive the process (the RL demo reads them after a stack died with its owner).
        model.kill()
        model = procs.start("model", tmp_path / "model", "--engine", engine.url)
        assert (await controller.status(model.url))["generated_on"] == {"initial": 2}
        status, reply = await controller.post(model.url, "/ng-rollout/r3/v1/chat/completions", {"messages": messages})
        assert status == 200 and (await controller.status(model.url))["generated_on"] == {"initial": 3}

        status, seeded = await controller.post(resources.url, "/ng-rollout/r1/seed_session", {"prompt": "p"})
        assert status == 200, seeded
        for act, ok in (("kiss x", True), ("abc de", False)):
            status, checked = await controller.post(resources.url, "/ng-rollout/r1/check",
                                                    {"session_id": seeded["session_id"], "action": act})
            assert (status, checked) == (200, {"ok": ok})
    finally:
        engine.kill()
