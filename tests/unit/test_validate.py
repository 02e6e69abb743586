"""`computedomain validate`: the check pods' channel-device check, the objects a run creates, and what it
prints. The run itself is tested on the simulated cluster (tests/cluster/system/test_validate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from computedomain.validate import (
    ChannelReport,
    NodeResult,
    Options,
    Result,
    channel_main,
    check_channels,
    job,
    table,
    verdict,
)


def _proc(tmp_path: Path, major: int) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "devices").write_text(f"Character devices:\n  1 mem\n{major} nvidia-caps-imex-channels\n\nBlock devices:\n")
    return proc


def _channels(tmp_path: Path, *names: str) -> Path:
    """Channel "devices": links to /dev/null, a character device with major 1 on every Linux."""
    channels = tmp_path / "dev" / "nvidia-caps-imex-channels"
    channels.mkdir(parents=True)
    for name in names:
        (channels / name).symlink_to("/dev/null")
    return channels


def test_a_channel_with_the_node_major_passes(tmp_path: Path) -> None:
    report = check_channels("gb-1", _channels(tmp_path, "channel0"), _proc(tmp_path, 1))
    assert report.ok and report.channels == (("channel0", 1, 3),) and report.expected_major == 1


@pytest.mark.parametrize(
    ("names", "major", "expected"),
    [
        (("channel0",), 509, "channel0 1:3: major is not the node's nvidia-caps-imex-channels 509"),
        ((), 1, "no channel device in"),
    ],
)
def test_a_wrong_or_missing_channel_fails_with_a_reason(
    tmp_path: Path, names: tuple[str, ...], major: int, expected: str
) -> None:
    report = check_channels("gb-1", _channels(tmp_path, *names), _proc(tmp_path, major))
    assert not report.ok and expected in report.reason


def test_no_channel_directory_or_no_driver_fails(tmp_path: Path) -> None:
    assert "no channel device" in check_channels("n", tmp_path / "none", _proc(tmp_path, 1)).reason
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "devices").write_text("Character devices:\n  1 mem\n")
    assert "no nvidia-caps-imex-channels major" in check_channels("n", tmp_path, tmp_path / "p").reason


def test_the_report_travels_as_a_bounded_termination_message(tmp_path: Path) -> None:
    report = ChannelReport("gb-1", (("channel0", 509, 0),), 509)
    assert ChannelReport.from_json(report.to_json()) == report
    assert len(ChannelReport("n", reason="x" * 10_000).to_json()) <= 4096
    hostile = ChannelReport.from_json('{"channels": [["a", "b"]]}')
    assert not hostile.ok and "unreadable check result" in hostile.reason
    log = tmp_path / "termination-log"
    env = {
        "NODE_NAME": "gb-1",
        "IMEX_CHANNELS_DIR": str(_channels(tmp_path, "channel0")),
        "PROC_ROOT": str(_proc(tmp_path, 1)),
        "TERMINATION_LOG": str(log),
    }
    assert channel_main(env) == 0
    assert ChannelReport.from_json(log.read_text()).channels == (("channel0", 1, 3),)


AGENT = {
    "spec": {
        "template": {
            "spec": {
                "volumes": [{"name": "driver-root", "hostPath": {"path": "/run/nvidia/driver"}}, {"name": "cdi"}],
                "containers": [
                    {
                        "name": "compute-domains",
                        "env": [{"name": "PROC_ROOT", "value": "/driver-root/proc"}, {"name": "X", "value": "1"}],
                        "volumeMounts": [{"name": "driver-root", "mountPath": "/driver-root"}, {"name": "cdi"}],
                    }
                ],
            }
        }
    }
}


def test_the_job_puts_one_pod_on_each_chosen_node_with_the_node_agents_view_of_the_driver() -> None:
    options = Options(namespace="ns", image="img:1", nodes=("gb-1", "gb-2"), run="r1")
    body = job(options, AGENT)
    spec = body["spec"]
    assert (spec["completions"], spec["parallelism"], spec["completionMode"]) == (2, 2, "Indexed")
    pod = spec["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][0]["values"] == ["gb-1", "gb-2"]
    (anti,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    assert anti["labelSelector"]["matchLabels"] == spec["template"]["metadata"]["labels"]
    (check,) = pod["initContainers"]
    assert check["command"] == ["python", "-m", "computedomain", "validate-channel"]
    assert {"name": "PROC_ROOT", "value": "/driver-root/proc"} in check["env"]
    assert check["volumeMounts"] == [{"name": "driver-root", "mountPath": "/driver-root", "readOnly": True}]
    assert pod["volumes"] == [{"name": "driver-root", "hostPath": {"path": "/run/nvidia/driver"}}]
    assert pod["resourceClaims"] == [{"name": "channel", "resourceClaimTemplateName": "validate-r1-channel"}]
    # Without a node agent found: the host's /proc, no mounts.
    bare = job(options, None)["spec"]["template"]["spec"]
    assert bare["volumes"] == [] and bare["initContainers"][0]["volumeMounts"] == []


def test_table_and_verdict() -> None:
    good = NodeResult(
        "gb-1", channel="channel0 509:0", daemon="READY (c.1, index 0)", times={"channel": 2.0, "daemon": 4.5}
    )
    bad = NodeResult("gb-2", reason="IMEX daemon NOT READY (c.1, index 1)", times={"channel": 2.1})
    failed = Result(nodes=[good, bad], domain="1 of 2 daemons ready")
    text = table(failed)
    assert text.splitlines()[0].split() == ["NODE", "CHANNEL", "DAEMON", "CHANNEL", "S", "DAEMON", "S", "RESULT"]
    assert "gb-1" in text and "4.5" in text and "FAIL: IMEX daemon NOT READY" in text
    assert verdict(failed) == "FAIL: 1 of 2 nodes; gb-2: IMEX daemon NOT READY (c.1, index 1)"
    passed = Result(nodes=[good], domain="Ready", times={"nodes": 0.5, "domain": 5.0})
    assert passed.ok and verdict(passed).startswith("PASS: 1 nodes")
    assert verdict(Result(nodes=[], reason="no node publishes")) == "FAIL: no node publishes"
