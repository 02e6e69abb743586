"""DaemonSettings from the env the DaemonSet and CDI give."""

from __future__ import annotations

import pytest

from computedomain.settings import SettingsError, load_settings
from imex.daemon.settings import DaemonSettings

CD = "1b4e28ba-2fa1-411d-8a1f-6ec5c1f3a8e2"
ENV = {
    "NODE_NAME": "gb-1",
    "POD_IP": "10.0.0.7",
    "POD_UID": "pod-uid",
    "POD_NAME": "computedomain-daemon-x",
    "POD_NAMESPACE": "nvidia-dra",
    "CLIQUE_ID": "cluster.3",
    "COMPUTE_DOMAIN_UUID": CD,
    "COMPUTE_DOMAIN_NAME": "cd1",
    "COMPUTE_DOMAIN_NAMESPACE": "user",
    "MAX_NODES_PER_IMEX_DOMAIN": "18",
    "FEATURE_GATES": "IMEXDaemonsWithDNSNames=true,ComputeDomainCliques=true,",
    "LOG_LEVEL": "debug",
}


def test_full_env() -> None:
    s = load_settings(DaemonSettings, environ=ENV)
    s.validate_for_run()
    assert (s.node_name, s.pod_ip, s.clique_id, s.cd_uid, s.max_nodes) == ("gb-1", "10.0.0.7", "cluster.3", CD, 18)
    assert s.dns_names and s.use_cliques
    assert s.clique_object_name == f"{CD}.cluster.3"
    assert str(s.imexd_cfg_path) == "/imexd/imexd.cfg" and str(s.nodes_cfg_path) == "/imexd/nodes.cfg"
    assert (s.hosts_file, s.imex_binary, s.imex_ctl_binary) == ("/etc/hosts", "nvidia-imex", "nvidia-imex-ctl")
    assert s.sigusr1_interval == 5.0


def test_paths_and_intervals_are_injectable_by_env_and_flag() -> None:
    s = load_settings(
        DaemonSettings,
        ["--imexd-dir", "/tmp/x", "--imex-sigusr1-interval", "1"],
        environ={**ENV, "HOSTS_FILE": "/tmp/hosts", "IMEX_BINARY": "/bin/sim"},
    )
    assert (s.imexd_dir, s.hosts_file, s.imex_binary, s.sigusr1_interval) == ("/tmp/x", "/tmp/hosts", "/bin/sim", 1.0)


def test_missing_cd_uid_names_cdi() -> None:
    s = load_settings(DaemonSettings, environ={**ENV, "COMPUTE_DOMAIN_UUID": ""})
    with pytest.raises(SettingsError, match=r"CDI container edits .* did not apply"):
        s.validate_for_run()


@pytest.mark.parametrize("missing", ["NODE_NAME", "POD_NAME", "POD_NAMESPACE", "POD_UID", "POD_IP"])
def test_missing_identity(missing: str) -> None:
    s = load_settings(DaemonSettings, environ={**ENV, missing: ""})
    with pytest.raises(SettingsError, match=f"{missing} is required"):
        s.validate_for_run()


def test_legacy_gates() -> None:
    s = load_settings(DaemonSettings, environ={**ENV, "FEATURE_GATES": "ComputeDomainCliques=false"})
    assert s.dns_names and not s.use_cliques
    with pytest.raises(SettingsError, match="ComputeDomainCliques=true requires IMEXDaemonsWithDNSNames"):
        load_settings(DaemonSettings, environ={**ENV, "FEATURE_GATES": "IMEXDaemonsWithDNSNames=false"})
    s = load_settings(
        DaemonSettings, environ={**ENV, "FEATURE_GATES": "IMEXDaemonsWithDNSNames=false,ComputeDomainCliques=false"}
    )
    assert not s.dns_names and not s.use_cliques
    with pytest.raises(SettingsError, match="COMPUTE_DOMAIN_NAME is required"):
        load_settings(
            DaemonSettings,
            environ={**ENV, "COMPUTE_DOMAIN_NAME": "", "FEATURE_GATES": "ComputeDomainCliques=false"},
        ).validate_for_run()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MAX_NODES_PER_IMEX_DOMAIN": "0"}, "at least 1"),
        ({"MAX_NODES_PER_IMEX_DOMAIN": "x"}, "must be an integer"),
        ({"IMEX_SIGUSR1_INTERVAL": "-1"}, "must not be negative"),
        ({"COMPUTE_DOMAIN_UUID": "not-a-uuid"}, "is not a UUID"),
        ({"CLIQUE_ID": "a/b"}, "malformed"),
    ],
)
def test_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(DaemonSettings, environ={**ENV, **env}).validate_for_run()


def test_check_needs_no_identity() -> None:
    s = load_settings(DaemonSettings, environ={"CLIQUE_ID": ""})
    assert s.clique_id == ""


def test_hostname_prefix_from_the_controller_or_derived() -> None:
    derived = load_settings(DaemonSettings, environ=ENV)
    assert derived.hostname_prefix == "compute-domain-daemon-1b4e28ba2fa1411d8a1f6ec5c1f3a8e2"
    given = load_settings(DaemonSettings, environ={**ENV, "IMEX_HOSTNAME_PREFIX": "cd-abc"})
    assert given.hostname_prefix == "cd-abc"
    with pytest.raises(SettingsError, match="IMEX_HOSTNAME_PREFIX"):
        load_settings(DaemonSettings, environ={**ENV, "IMEX_HOSTNAME_PREFIX": "Bad_Prefix"})
