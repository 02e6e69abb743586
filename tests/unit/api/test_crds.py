"""The checked-in CRDs are exactly what the models generate, and the generated schema says what SPEC
section 2 says."""

from pathlib import Path
from typing import Any

import yaml

from computedomain.api import crdgen

CRD_DIR = Path(__file__).resolve().parents[3] / "manifests" / "crds"


def test_checked_in_crds_match_the_models() -> None:
    rendered = crdgen.render_all()
    on_disk = {p.name: p.read_text() for p in CRD_DIR.glob("*.yaml")}
    assert set(on_disk) == set(rendered), "run `make crds`"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} is stale: run `make crds`"


def _version(crd: dict[str, Any]) -> dict[str, Any]:
    (version,) = crd["spec"]["versions"]
    return version


def test_compute_domain_schema() -> None:
    crd = crdgen.compute_domain_crd()
    version = _version(crd)
    assert crd["metadata"]["name"] == "computedomains.resource.nvidia.com"
    assert crd["spec"]["scope"] == "Namespaced"
    assert version["name"] == "v1beta1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns] == ["Status", "Nodes", "Age", "Channels"]
    assert columns[-1]["priority"] == 1  # channel isolation only: shown with -o wide
    assert "cd" in crd["spec"]["names"]["shortNames"]

    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["x-kubernetes-validations"][0]["rule"] == "self == oldSelf"
    assert spec["required"] == ["channel"]
    num_nodes = spec["properties"]["numNodes"]
    assert (num_nodes["type"], num_nodes["default"], num_nodes["minimum"]) == ("integer", 0, 0)
    channel = spec["properties"]["channel"]
    assert channel["required"] == ["resourceClaimTemplate"]
    assert channel["properties"]["resourceClaimTemplate"]["required"] == ["name"]
    mode = channel["properties"]["allocationMode"]
    assert (mode["enum"], mode["default"]) == (["Single", "All"], "Single")

    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert status["status"]["enum"] == ["Ready", "NotReady"]
    nodes = status["nodes"]
    assert nodes["x-kubernetes-list-type"] == "map" and nodes["x-kubernetes-list-map-keys"] == ["name"]
    assert set(nodes["items"]["properties"]) == {"name", "ipAddress", "cliqueID", "index", "status"}
    conditions = status["conditions"]
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) == {"type", "status", "lastTransitionTime", "reason", "message"}
    channels = status["channels"]
    assert channels["x-kubernetes-list-map-keys"] == ["cliqueID"]
    assert channels["items"]["properties"]["channel"]["minimum"] == 1


def test_clique_schema() -> None:
    crd = crdgen.compute_domain_clique_crd()
    version = _version(crd)
    assert "subresources" not in version
    schema = version["schema"]["openAPIV3Schema"]
    daemons = schema["properties"]["daemons"]
    assert daemons["x-kubernetes-list-map-keys"] == ["nodeName"]
    assert daemons["items"]["required"] == ["nodeName", "ipAddress", "cliqueID"]
    # Channel isolation: optional fields, so every object valid for the reference stays valid.
    assert "required" not in schema
    assert schema["properties"]["channel"] == {
        "description": schema["properties"]["channel"]["description"],
        "type": "integer",
        "minimum": 1,
    }
    claims = schema["properties"]["preparedClaims"]
    assert claims["x-kubernetes-list-map-keys"] == ["claimUID", "nodeName"]
    assert claims["items"]["required"] == ["claimUID", "nodeName"]
    (rule,) = schema["x-kubernetes-validations"]
    assert "oldSelf.channel" in rule["rule"]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Channel", "Age"]


def test_generated_yaml_is_parseable_and_headed() -> None:
    for text in crdgen.render_all().values():
        assert text.startswith("# Generated")
        assert yaml.safe_load(text)["kind"] == "CustomResourceDefinition"
