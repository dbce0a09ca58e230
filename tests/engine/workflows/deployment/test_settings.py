"""Bad input in ``deployment.services``: each a typed error naming the service and the key, refused
when the configuration is loaded, before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.config import ConfigError, load
from engine.workflows.deployment.plan import Plan, StackConfigError
from engine.config.deployment import DeploymentSettingsModel, substitute


def _svc(**extra: Any) -> dict[str, Any]:
    return {"command": ["python", "-c", "pass"], **extra}


def _load(tmp_path: Path, services: dict[str, Any]) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"deployment": {"services": services}}))
    with pytest.raises(ConfigError) as info:
        load(cfg)
    return str(info.value)


@pytest.mark.parametrize(("services", "said"), [
    ({"a": _svc(depends_on=["b"]), "b": _svc(depends_on=["c"]), "c": _svc(depends_on=["a"])},
     "a dependency cycle: a -> b -> c -> a"),
    ({"a": _svc(depends_on=["a"])}, "services.a.depends_on: a service cannot depend on itself"),
    ({"a": _svc(depends_on=["nope"])}, "services.a.depends_on: 'nope' is not a service of the stack"),
    ({"a": {"env": {"X": "1"}}}, "deployment.services.a.command: Field required"),
    ({"a": _svc(command=[])}, "deployment.services.a.command: Value error, must name a program"),
    ({"a": _svc(command="")}, "deployment.services.a.command: Value error, must name a program"),
    ({"a": _svc(readiness={"http": "http://x/", "timeout_s": 0})},
     "deployment.services.a.readiness.timeout_s: Input should be greater than 0"),
    ({"a": _svc(readiness={"command": ["true"], "deadline_s": 0})},
     "deployment.services.a.readiness.deadline_s: Input should be greater than 0"),
    ({"a": _svc(command=["run", "${endpoints.ghost}"])},
     "services.a.command[1]: ${endpoints.ghost} names a service the stack does not declare"),
    ({"a": _svc(endpoint="http://{host}:1"), "b": _svc(env={"U": "${endpoints.a}"})},
     "services.b.env.U: ${endpoints.a}: 'a' is not among 'b''s dependencies"),
    ({"a": _svc(), "b": _svc(depends_on=["a"], command=["x", "${endpoints.a}"])},
     "services.b.command[1]: ${endpoints.a}: service 'a' declares no endpoint"),
    ({"a": _svc(command=["x", "--key", "${env.SECRET}"])},
     "services.a.command[2]: ${env.SECRET} may appear only in env values"),
    ({"a": _svc(command=["x", "${endpoint.a}"])}, "services.a.command[1]: ${endpoint.a} is not a reference"),
    ({"../a": _svc()}, "'../a' is not a service name"),
    ({"a": _svc(executor="k8s")}, "deployment.services.a.executor: Input should be 'uni' or 'ray'"),
    ({"a": _svc(ray={"num_cpus": 1})}, "ray options are given, but executor is 'uni'"),
    ({"a": _svc(executor="ray", ray={"num_gpus": -1})}, "deployment.services.a.ray.num_gpus: Input should be greater"),
    ({"a": _svc(depends_on=["b", "b"]), "b": _svc()}, "deployment.services.a.depends_on: Value error, names a service twice"),
    ({"a": _svc(readiness={"http": "http://x/", "command": ["true"]})}, "give http or command, not both"),
    ({"a": _svc(env={"1X": "v"})}, "'1X' is not an environment variable name"),
])
def test_each_bad_stack_is_refused_naming_service_and_key(tmp_path: Path, services: dict[str, Any],
                                                           said: str) -> None:
    assert said in _load(tmp_path, services)


def test_an_unset_environment_reference_is_refused_before_anything_starts() -> None:
    settings = DeploymentSettingsModel.model_validate({"services": {"a": _svc(env={"K": "${env.TIDELOG_TEST_UNSET}"})}})
    with pytest.raises(StackConfigError, match=r"deployment.services.a.env.K: names \$\{env.TIDELOG_TEST_UNSET\}"):
        Plan.build(settings, environ={})
    plan = Plan.build(settings, environ={"TIDELOG_TEST_UNSET": "s3cret"})
    assert plan.order == ("a",)


def test_order_puts_each_service_after_its_dependencies() -> None:
    settings = DeploymentSettingsModel.model_validate({"services": {
        "d": _svc(depends_on=["c"]), "c": _svc(depends_on=["a", "b"]), "a": _svc(), "b": _svc()}})
    plan = Plan.build(settings, environ={})
    assert plan.order == ("a", "b", "c", "d")
    assert plan.dependents("a") == ["c"] and plan.dependents("d") == []


def test_substitution() -> None:
    assert substitute("${endpoints.a}/x $${literal}", {"a": "http://h:1"}) == "http://h:1/x ${literal}"
    assert substitute("k=${env.V}", {}, {"V": "1"}) == "k=1"
