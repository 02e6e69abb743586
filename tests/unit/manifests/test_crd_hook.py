"""The CRD hook's script (files/crds.py) against a recording stand-in of the API client: what it refuses
(a spec that would stop serving a stored version), what it leaves alone (a CRD not installed), how it
retries a conflict. The update itself against the real apiserver: tests/cluster/manifests."""

from __future__ import annotations

import copy
import importlib.util
from typing import Any

import pytest
import yaml

from computedomain.kube.errors import Conflict, NotFound
from tests.unit.manifests.chart import CHART, REPO

_spec = importlib.util.spec_from_file_location("chart_crds_hook", CHART / "files" / "crds.py")
assert _spec and _spec.loader
hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hook)

WANTED = yaml.safe_load((REPO / "manifests" / "crds" / "resource.nvidia.com_computedomains.yaml").read_text())


class Api:
    def __init__(self, current: dict[str, Any] | None, conflicts: int = 0) -> None:
        self.current, self.conflicts, self.puts = current, conflicts, []

    async def get(self, _resource: Any, name: str) -> dict[str, Any]:
        if self.current is None:
            raise NotFound(f"{name} not found")
        return copy.deepcopy(self.current)

    async def replace(self, _resource: Any, body: dict[str, Any]) -> dict[str, Any]:
        self.puts.append(body)
        if self.conflicts:
            self.conflicts -= 1
            raise Conflict("the object has been modified")
        return body


def _installed(stored: list[str]) -> dict[str, Any]:
    old = copy.deepcopy(WANTED)
    old["metadata"].update(resourceVersion="7", annotations={"keep": "me"})
    old["spec"]["names"].pop("shortNames")
    old["status"] = {"storedVersions": stored}
    return old


async def test_replaces_the_spec_and_keeps_metadata_and_status(capsys: pytest.CaptureFixture[str]) -> None:
    api = Api(_installed(["v1beta1"]), conflicts=1)
    assert await hook.bring_up_to_date(api, WANTED)
    assert len(api.puts) == 2, "a conflict is retried with a fresh read"
    body = api.puts[-1]
    assert body["spec"] == WANTED["spec"]
    assert body["metadata"]["annotations"] == {"keep": "me"} and body["metadata"]["resourceVersion"] == "7"
    assert body["status"] == {"storedVersions": ["v1beta1"]}
    assert "is current (short names cd, 4 printer columns" in capsys.readouterr().out


async def test_a_stored_version_the_chart_does_not_serve_changes_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    api = Api(_installed(["v1beta1", "v1beta2"]))
    assert not await hook.bring_up_to_date(api, WANTED)
    assert api.puts == []
    out = capsys.readouterr().out
    assert "has objects stored as v1beta2, which this chart does not serve (v1beta1); nothing changed" in out


async def test_a_crd_that_is_not_installed_is_left_alone(capsys: pytest.CaptureFixture[str]) -> None:
    api = Api(None)
    assert await hook.bring_up_to_date(api, WANTED)
    assert api.puts == [] and "is not installed" in capsys.readouterr().out


async def test_gives_up_when_the_crd_keeps_changing() -> None:
    api = Api(_installed(["v1beta1"]), conflicts=99)
    assert not await hook.bring_up_to_date(api, WANTED)
    assert len(api.puts) == hook.ATTEMPTS


async def test_a_downgrade_leaves_a_newer_charts_crd_alone(capsys: pytest.CaptureFixture[str]) -> None:
    installed = _installed(["v1beta1"])
    installed["metadata"]["annotations"][hook.VERSION_ANNOTATION] = "0.7.0"
    api = Api(installed)
    assert await hook.bring_up_to_date(api, WANTED, "0.6.2")
    assert (
        api.puts == [] and "is from chart 0.7.0, newer than this chart (0.6.2); left alone" in capsys.readouterr().out
    )
    # The same or an older chart's CRD is brought up to date and stamped with this chart's version.
    for older in ("0.6.2", "0.5.9", "not-a-version"):
        installed["metadata"]["annotations"][hook.VERSION_ANNOTATION] = older
        api = Api(installed)
        assert await hook.bring_up_to_date(api, WANTED, "0.6.2")
        assert api.puts[-1]["metadata"]["annotations"] == {"keep": "me", hook.VERSION_ANNOTATION: "0.6.2"}
        assert api.puts[-1]["spec"] == WANTED["spec"]
