"""The chart's `helm test` hook: the project image running `python -m computedomain validate` with the
values' choice of nodes, in hook objects only (nothing of it exists after a plain install)."""

from __future__ import annotations

from typing import Any

from tests.unit.manifests.chart import HOST_MANAGED, Rendered, render


def _hook(r: Rendered) -> dict[str, Any]:
    (pod,) = [o for o in r.all("Pod") if o["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"]
    return pod


def test_the_hook_runs_validate_with_the_values() -> None:
    r = render(
        "validation.count=3",
        "validation.nodeSelector=nvidia.com/gpu.clique=c.1",
        "validation.namespace=cd-check",
        "validation.timeoutSeconds=120",
        hooks=True,
    )
    pod = _hook(r)
    (container,) = pod["spec"]["containers"]
    args = container["command"]
    assert args[:4] == ["python", "-m", "computedomain", "validate"]
    image = r.one("Deployment", component="controller")["spec"]["template"]["spec"]["containers"][0]["image"]
    assert container["image"] == image and f"--image={image}" in args
    assert {"--count=3", "--namespace=cd-check", "--timeout=120", "--node-selector=nvidia.com/gpu.clique=c.1"} <= set(
        args
    )
    assert "--host-managed" not in args and not any(a.startswith("--nodes=") for a in args)
    role = next(o for o in r.all("Role") if o["metadata"]["name"] == pod["spec"]["serviceAccountName"])
    assert role["metadata"]["namespace"] == "cd-check"
    resources = {res for rule in role["rules"] for res in rule["resources"]}
    assert resources == {"computedomains", "jobs", "pods", "events", "resourceclaimtemplates"}
    for obj in r.objects:
        if obj["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "validate":
            assert obj["metadata"]["annotations"]["helm.sh/hook"] == "test", obj["kind"]


def test_named_nodes_and_host_managed() -> None:
    args = _hook(render("validation.nodes={gb-1,gb-2}", *HOST_MANAGED, hooks=True))["spec"]["containers"][0]["command"]
    assert "--nodes=gb-1,gb-2" in args and "--host-managed" in args


def test_a_plain_install_has_none_of_it() -> None:
    assert not [
        o for o in render().objects if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "validate"
    ]
