"""Kubeconfigs through kubernetes-asyncio's loader: several files merged as kubectl merges them, tokens, token
files, exec plugins (token and client-certificate output, renewed before expiry and after a 401), path
prefixes, tls-server-name, proxy-url, and what client-go refuses, each a one-line error naming the file."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from computedomain.kube import config, kubeconfig
from computedomain.kube.config import ConfigError, TokenFile

pytestmark = pytest.mark.timeout(20)


def _write(path: Path, clusters: dict[str, Any], users: dict[str, Any], contexts: dict[str, Any], **top: Any) -> Path:
    data = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": n, "cluster": c} for n, c in clusters.items()],
        "users": [{"name": n, "user": u} for n, u in users.items()],
        "contexts": [{"name": n, "context": c} for n, c in contexts.items()],
        **top,
    }
    path.write_text(json.dumps(data))
    return path


def _one(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    return _write(
        tmp_path / "kubeconfig",
        {"c": cluster or {"server": "http://127.0.0.1:8080"}},
        {"u": user},
        {"x": {"cluster": "c", "user": "u"}},
        **{"current-context": "x"},
    )


def _ca() -> str:
    pem = ssl.get_default_verify_paths().openssl_cafile or ""
    if not Path(pem).is_file():
        pytest.skip("no system CA bundle to stand in for a cluster CA")
    return pem


async def test_token_kubeconfig(tmp_path: Path) -> None:
    creds = await config.load(_one(tmp_path, {"token": "abc"}))
    assert creds.server == "http://127.0.0.1:8080"
    assert creds.ssl_context is None
    assert await creds.auth.authorization() == "Bearer abc"
    assert "context x" in creds.source


async def test_several_files_merge_as_kubectl_merges_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KUBECONFIG=a:b: the context in one file, its cluster and user in the other; the first file that names
    a cluster or sets current-context wins."""
    a = _write(
        tmp_path / "a",
        {"c": {"server": "http://10.0.0.1:6443"}},
        {"u": {"token": "from-a"}},
        {},
        **{"current-context": "x"},
    )
    b = _write(
        tmp_path / "b",
        {"c": {"server": "http://10.9.9.9:6443"}},
        {},
        {"x": {"cluster": "c", "user": "u"}, "y": {"cluster": "c"}},
        **{"current-context": "y"},
    )
    monkeypatch.setenv("KUBECONFIG", f"{a}{os.pathsep}{tmp_path / 'absent'}{os.pathsep}{b}")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    creds = await config.load()
    assert creds.server == "http://10.0.0.1:6443"
    assert await creds.auth.authorization() == "Bearer from-a"


async def test_a_relative_token_file_is_read_again(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nclusters:\n- name: c\n  cluster: {server: 'https://10.0.0.1:6443', insecure-skip-tls-verify: true}\n"
        "users:\n- name: u\n  user: {tokenFile: tok}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        "current-context: x\n"
    )
    creds = await config.load(path)
    assert creds.ssl_context is not None and creds.ssl_context.verify_mode == ssl.CERT_NONE
    assert isinstance(creds.auth, TokenFile)
    assert await creds.auth.authorization() == "Bearer from-file"


async def test_path_prefix_tls_server_name_and_proxy_url(tmp_path: Path) -> None:
    cluster = {
        "server": "https://gateway.example:8443/k8s/clusters/c-1/",
        "certificate-authority": _ca(),
        "tls-server-name": "kubernetes.default.svc",
        "proxy-url": "http://proxy.example:3128",
    }
    creds = await config.load(_one(tmp_path, {"token": "t"}, cluster))
    assert creds.server == "https://gateway.example:8443/k8s/clusters/c-1"
    assert creds.server_hostname == "kubernetes.default.svc"
    assert creds.proxy == "http://proxy.example:3128"
    assert creds.ssl_context is not None and creds.ssl_context.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("cluster", "message"),
    [
        # a quoted "false" reads as true in kubernetes-asyncio's loader: verification would be off
        ({"insecure-skip-tls-verify": "false"}, "insecure-skip-tls-verify must be true or false, not 'false'"),
        ({"insecure-skip-tls-verify": True, "certificate-authority": "ca.crt"}, "next to a certificate authority"),
        ({"proxy-url": "socks5://127.0.0.1:1080"}, "proxy-url 'socks5://127.0.0.1:1080' is not supported"),
        ({"server": ""}, "the cluster has no server"),
    ],
)
async def test_what_client_go_refuses_is_one_line(tmp_path: Path, cluster: dict[str, Any], message: str) -> None:
    path = _one(tmp_path, {"token": "t"}, {"server": "https://10.0.0.1:6443", **cluster})
    with pytest.raises(ConfigError, match=message) as caught:
        await config.load(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


async def test_missing_pieces_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no kubeconfig at"):
        await config.load(tmp_path / "absent")
    path = _one(tmp_path, {"token": "t"})
    with pytest.raises(ConfigError, match="other"):
        await config.load(path, context="other")
    (tmp_path / "bad").write_text("clusters: [unclosed\n")
    with pytest.raises(ConfigError, match="is not YAML"):
        await config.load(tmp_path / "bad")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ConfigError, match="must be a mapping"):
        await config.load(tmp_path / "empty")


def _plugin(tmp_path: Path, status: str) -> dict[str, Any]:
    """An exec plugin that counts its runs in ``runs`` and prints the ExecCredential ``status`` (Python)."""
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, os, sys, pathlib\n"
        f"runs = pathlib.Path({str(tmp_path / 'runs')!r})\n"
        "n = len(runs.read_text()) if runs.exists() else 0\n"
        "runs.write_text('x' * (n + 1))\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        f"status = {status}\n"
        "print(json.dumps({'apiVersion': info['apiVersion'], 'kind': 'ExecCredential', 'status': status}))\n"
    )
    return {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(plugin), "arg"],
            "env": [{"name": "GREETING", "value": "hi"}],
        }
    }


def _runs(tmp_path: Path) -> int:
    return len((tmp_path / "runs").read_text())


async def test_exec_plugin_token_renewed_before_it_expires_and_after_a_401(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    soon = (datetime.now(UTC) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    user = _plugin(
        tmp_path,
        "{'token': os.environ['GREETING'] + '-' + sys.argv[1] + str(n), " + f"'expirationTimestamp': {soon!r}" + "}",
    )
    creds = await config.load(_one(tmp_path, user))
    assert await creds.auth.authorization() == "Bearer hi-arg0"
    assert await creds.auth.rejected("Bearer hi-arg0")
    assert await creds.auth.authorization() == "Bearer hi-arg1"
    monkeypatch.setattr(kubeconfig, "_RENEW_CHECK_S", 0.0)
    # within the loader's five minutes of expiry: the next request carries a new token
    assert await creds.auth.authorization() == "Bearer hi-arg2"
    assert _runs(tmp_path) == 3


async def test_exec_plugin_without_expiry_runs_once_until_a_401(tmp_path: Path) -> None:
    creds = await config.load(_one(tmp_path, _plugin(tmp_path, "{'token': 't' + str(n)}")))
    for _ in range(3):
        assert await creds.auth.authorization() == "Bearer t0"
    assert await creds.auth.rejected("Bearer t0")
    assert await creds.auth.authorization() == "Bearer t1"
    assert _runs(tmp_path) == 2


async def test_exec_plugin_command_relative_to_the_kubeconfig(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    plugin = tmp_path / "bin" / "cred"
    plugin.write_text(
        '#!/bin/sh\necho \'{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",'
        ' "status": {"token": "rel"}}\'\n'
    )
    plugin.chmod(0o755)
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "./bin/cred"}}
    path = _one(tmp_path, user)
    monkeypatch.chdir("/")
    creds = await config.load(path)
    assert await creds.auth.authorization() == "Bearer rel"


async def test_exec_plugin_failure_is_one_line(tmp_path: Path) -> None:
    user = {"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "false"}}
    with pytest.raises(ConfigError, match="exec: process returned 1") as caught:
        await config.load(_one(tmp_path, user))
    assert "kubeconfig" in str(caught.value)


def _certificate(tmp_path: Path) -> tuple[str, str]:
    key, cert = tmp_path / "client.key", tmp_path / "client.crt"
    try:
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=client"],
            check=True, capture_output=True,
        )  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("openssl cannot make a client certificate here")
    return cert.read_text(), key.read_text()


async def test_exec_plugin_client_certificate_renewed_before_it_expires_and_after_a_401(tmp_path: Path) -> None:
    cert, key = _certificate(tmp_path)
    soon = (datetime.now(UTC) + timedelta(minutes=2)).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {"clientCertificateData": cert, "clientKeyData": key, "expirationTimestamp": soon}
    user = _plugin(tmp_path, repr(status))
    creds = await config.load(_one(tmp_path, user, {"server": "https://10.0.0.1:6443", "certificate-authority": _ca()}))
    first = creds.auth.tls
    assert first is not None and first.verify_mode == ssl.CERT_REQUIRED
    assert await creds.auth.authorization() is None, "a certificate, no bearer token"
    second = creds.auth.tls
    assert second is not None and second is not first, "within five minutes of its expiry: a new certificate"
    assert await creds.auth.rejected(None)
    assert creds.auth.tls is not second
    assert _runs(tmp_path) == 4  # the loader's run, ours at load, before expiry, after the 401


async def test_a_bad_client_certificate_is_one_line(tmp_path: Path) -> None:
    bad = "bm90IGEgY2VydGlmaWNhdGU="  # "not a certificate"
    user = {"client-certificate-data": bad, "client-key-data": bad}
    with pytest.raises(ConfigError, match="cannot load the client certificate"):
        await config.load(_one(tmp_path, user, {"server": "https://10.0.0.1:6443", "certificate-authority": _ca()}))
