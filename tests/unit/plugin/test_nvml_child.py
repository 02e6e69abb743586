"""The node agent's NVML reads in a child process (`computedomain.plugin.nvml_child`): the same answers and
errors as `imex.nvml` in process, against the mock NVML library of a fake driver root (a real child
process), and a bounded, one-line refusal of anything else a child might print."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from computedomain.plugin.nvml_child import MAX_OUTPUT, ChildNvmlSource
from imex.discovery import DriverVersion, FabricError, NvmlError, NvmlUnavailableError
from imex.nvml import NvmlFabricSource
from tests.testbed.fake_driver_root import SimulatedNode, lib_dir, write_fake_driver_root

CLUSTER = uuid.UUID("00112233-4455-6677-8899-aabbccddeeff")


def _tray(**extra: object) -> SimulatedNode:
    return SimulatedNode.model_validate(
        {"name": "tray", "clique": {"clusterUUID": str(CLUSTER), "cliqueId": 5}, **extra}
    )


@pytest.mark.parametrize("node", [None, _tray(), _tray(fabricState="IN_PROGRESS", fabricStatusOK=False)])
def test_the_child_answers_as_imex_nvml_does_in_process(tmp_path: Path, node: SimulatedNode | None) -> None:
    root = write_fake_driver_root(tmp_path / "root", node, imex=False)
    child, here = ChildNvmlSource(root), NvmlFabricSource(root)
    assert child.gpu_fabric_infos() == here.gpu_fabric_infos()
    assert child.driver_version() == here.driver_version()
    assert str(child.driver_version()) == str(here.driver_version())


def test_a_read_started_early_answers_the_first_query_and_later_ones_start_their_own(tmp_path: Path) -> None:
    root = write_fake_driver_root(tmp_path / "root", _tray(), imex=False)
    later = _Child(json.dumps({**GOOD, "gpus": []}).encode())
    source = ChildNvmlSource(root, run=later).start()
    assert source.gpu_fabric_infos() == NvmlFabricSource(root).gpu_fabric_infos()  # the early child's answer
    assert later.runs == 0
    assert source.driver_version() == NvmlFabricSource(root).driver_version()  # reused from that read
    assert source.gpu_fabric_infos() == [] and later.runs == 1


def test_an_early_read_that_cannot_start_is_reported_by_the_first_query(tmp_path: Path) -> None:
    source = ChildNvmlSource(tmp_path, python=str(tmp_path / "no-python")).start()
    with pytest.raises(NvmlError, match="cannot start the NVML read"):
        source.gpu_fabric_infos()


def test_an_early_read_past_its_timeout_is_killed_and_a_timeout_error(tmp_path: Path) -> None:
    sleeper = tmp_path / "python"
    sleeper.write_text("#!/bin/sh\nexec sleep 30\n")
    sleeper.chmod(0o755)
    source = ChildNvmlSource(tmp_path, python=str(sleeper), timeout_s=0.2).start()
    early = source._early
    assert early is not None
    with pytest.raises(NvmlError, match=r"took over 0\.2s"):
        source.gpu_fabric_infos()
    assert early.returncode is not None  # killed and reaped, not left running


def test_an_unavailable_library_is_the_same_error(tmp_path: Path) -> None:
    root = write_fake_driver_root(tmp_path / "root", None, imex=False)
    for library in (root / lib_dir()).glob("libnvidia-ml.so*"):
        library.unlink()
    with pytest.raises(NvmlUnavailableError) as here:
        NvmlFabricSource(root).gpu_fabric_infos()
    with pytest.raises(NvmlUnavailableError) as child:
        ChildNvmlSource(root).gpu_fabric_infos()
    assert str(child.value) == str(here.value)
    with pytest.raises(NvmlUnavailableError):
        ChildNvmlSource(root).driver_version()


class _Child:
    """Stands in for the child process: what it prints, how it exits; counts the runs."""

    def __init__(self, stdout: bytes = b"", returncode: int = 0, stderr: bytes = b"") -> None:
        self.stdout, self.returncode, self.stderr = stdout, returncode, stderr
        self.runs = 0

    def __call__(self, argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[bytes]:
        self.runs += 1
        assert argv[1:3] == ["-m", "computedomain.plugin.nvml_child"]
        return subprocess.CompletedProcess(argv, self.returncode, self.stdout, self.stderr)


GOOD: dict[str, Any] = {
    "driver_version": "580.159.04",
    "gpus": [
        {
            "gpu": "0",
            "state": "COMPLETED",
            "cluster_uuid": str(CLUSTER),
            "clique_id": 5,
            "status_ok": True,
            "status_text": "",
        }
    ],
}


def test_the_driver_version_of_a_recent_read_is_reused() -> None:
    now = [0.0]
    child = _Child(json.dumps(GOOD).encode())
    source = ChildNvmlSource(Path("/driver"), run=child, reuse_s=60, clock=lambda: now[0])
    assert source.gpu_fabric_infos()[0].clique_id == 5
    assert source.driver_version() == DriverVersion.parse("580.159.04")
    assert child.runs == 1
    now[0] = 61.0
    source.driver_version()
    assert child.runs == 2
    source.gpu_fabric_infos()  # the clique is always read afresh
    assert child.runs == 3


def test_errors_keep_their_type_per_query() -> None:
    answer = {**GOOD, "gpus": {"error": "FabricError", "message": "NVML reported unknown GPU fabric state 9"}}
    source = ChildNvmlSource(Path("/driver"), run=_Child(json.dumps(answer).encode()))
    with pytest.raises(FabricError, match="unknown GPU fabric state 9"):
        source.gpu_fabric_infos()
    assert source.driver_version() == DriverVersion.parse("580.159.04")
    answer = {"driver_version": {"error": "NvmlError", "message": "NVML init failed", "code": 999}, "gpus": []}
    with pytest.raises(NvmlError) as err:
        ChildNvmlSource(Path("/driver"), run=_Child(json.dumps(answer).encode())).driver_version()
    assert err.value.code == 999
    answer = {"driver_version": {"error": "SystemExit", "message": "odd"}, "gpus": []}
    with pytest.raises(NvmlError, match="odd"):  # an unknown type arrives as NvmlError
        ChildNvmlSource(Path("/driver"), run=_Child(json.dumps(answer).encode())).driver_version()


@pytest.mark.parametrize(
    ("child", "why"),
    [
        (_Child(b"not json"), "answered badly"),
        (_Child(b"[]"), "answered badly"),
        (_Child(json.dumps({**GOOD, "gpus": [{**GOOD["gpus"][0], "state": "MELTED"}]}).encode()), "answered badly"),
        (_Child(json.dumps({**GOOD, "gpus": [{**GOOD["gpus"][0], "clique_id": "5"}]}).encode()), "answered badly"),
        (_Child(json.dumps({**GOOD, "gpus": [{"gpu": "0"}]}).encode()), "answered badly"),
        (_Child(b"{}", returncode=1, stderr=b"Traceback ...\nImportError: no pynvml\n"), "ImportError: no pynvml"),
        (_Child(b" " * (MAX_OUTPUT + 1)), "failed"),
    ],
)
def test_a_bad_child_answer_is_one_line_naming_the_driver_root(child: _Child, why: str) -> None:
    with pytest.raises(NvmlError) as err:
        ChildNvmlSource(Path("/driver"), run=child).gpu_fabric_infos()
    assert why in str(err.value) and "/driver" in str(err.value) and "\n" not in str(err.value)


def test_a_hung_child_is_a_timeout_error() -> None:
    def hung(argv: list[str], timeout_s: float) -> subprocess.CompletedProcess[bytes]:
        raise subprocess.TimeoutExpired(argv, timeout_s)

    with pytest.raises(NvmlError, match="took over 30s"):
        ChildNvmlSource(Path("/driver"), run=hung, timeout_s=30).gpu_fabric_infos()
