"""The start-up version check: the apiserver's own discovery answers (as 1.32, 1.33, 1.34 and providers give
them) in, the one line that stops a component out."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from computedomain.kube.errors import NotFound, Transient
from computedomain.kube.version import UnsupportedServerError, check, require_supported, server_version


def version(minor: str, git: str) -> dict[str, Any]:
    return {"major": "1", "minor": minor, "gitVersion": git, "platform": "linux/amd64", "goVersion": "go1.24.4"}


def group(*served: str) -> dict[str, Any]:
    versions = [{"groupVersion": f"resource.k8s.io/{v}", "version": v} for v in served]
    return {"kind": "APIGroup", "apiVersion": "v1", "name": "resource.k8s.io", "versions": versions}


V1_34 = version("34", "v1.34.1")
V1_33_EKS = version("33+", "v1.33.4-eks-1b0b7f6")


class FakeDiscovery:
    """The two discovery answers a component asks for, or the error the apiserver gives."""

    def __init__(self, info: dict[str, Any] | Exception, resource: dict[str, Any] | Exception) -> None:
        self.answers = {"/version": info, "/apis/resource.k8s.io": resource}
        self.asked: list[str] = []

    async def discover(self, path: str) -> dict[str, Any]:
        self.asked.append(path)
        answer = self.answers[path]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        (V1_34, (1, 34)),
        (V1_33_EKS, (1, 33)),
        (version("", "v1.35.0-alpha.1"), (1, 35)),
        ({"gitVersion": "garbage"}, None),
    ],
)
def test_server_version(info: dict[str, Any], expected: tuple[int, int] | None) -> None:
    assert server_version(info) == expected


async def test_1_34_with_resource_v1_is_supported() -> None:
    fake = FakeDiscovery(V1_34, group("v1", "v1beta2", "v1beta1"))
    await require_supported(fake, "the controller")  # type: ignore[arg-type]
    assert fake.asked == ["/version", "/apis/resource.k8s.io"]


@pytest.mark.parametrize(
    ("info", "resource", "says"),
    [
        (V1_33_EKS, group("v1beta2", "v1beta1"), "the apiserver is v1.33.4-eks-1b0b7f6: upgrade the cluster"),
        (version("32", "v1.32.9"), group("v1beta1"), "the apiserver is v1.32.9"),
        (V1_34, group("v1beta2"), "serves resource.k8s.io versions: v1beta2. Enable resource.k8s.io/v1"),
        (V1_34, NotFound("the server could not find the requested resource"), "versions: none"),
    ],
)
async def test_an_older_apiserver_stops_the_component_naming_both_versions(
    info: dict[str, Any], resource: dict[str, Any] | Exception, says: str
) -> None:
    with pytest.raises(UnsupportedServerError) as err:
        await require_supported(FakeDiscovery(info, resource), "the node agent")  # type: ignore[arg-type]
    message = str(err.value)
    assert message.startswith("the node agent needs Kubernetes 1.34 or later (serving resource.k8s.io/v1)")
    assert says in message and "\n" not in message


async def test_an_apiserver_that_does_not_answer_is_no_reason_to_stop(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    await require_supported(FakeDiscovery(Transient("connection refused"), group("v1")), "the node agent")  # type: ignore[arg-type]
    assert "could not ask the apiserver for its version" in caplog.text


def test_check_is_pure_and_bounded() -> None:
    huge = version("33", "v1.33." + "9" * 10_000)
    message = check("x", huge, ["v1"])
    assert message is not None and len(message) < 300
