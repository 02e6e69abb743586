"""Credentials: kubeconfig (JSON and YAML, files relative to it, tokens, token files, exec plugins) and the
in-cluster service account, each with a one-line error for what cannot be used."""

from __future__ import annotations

import base64
import json
import ssl
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from computedomain.kube import config
from computedomain.kube.config import ConfigError, TokenFile

pytestmark = pytest.mark.timeout(10)


def _kubeconfig(tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None) -> Path:
    data = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster or {"server": "http://127.0.0.1:8080"}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(data))
    return path


async def test_token_kubeconfig_in_json(tmp_path: Path) -> None:
    creds = config.load(_kubeconfig(tmp_path, {"token": "abc"}))
    assert creds.endpoint.url == "http://127.0.0.1:8080"
    assert creds.ssl_context is None
    assert await creds.token() == "abc"


async def test_yaml_kubeconfig_with_relative_token_file(tmp_path: Path) -> None:
    (tmp_path / "tok").write_text("from-file\n")
    path = tmp_path / "kubeconfig"
    path.write_text(
        "apiVersion: v1\nclusters:\n- name: c\n  cluster: {server: 'https://10.0.0.1:6443', insecure-skip-tls-verify: true}\n"
        "users:\n- name: u\n  user: {tokenFile: tok}\ncontexts:\n- name: x\n  context: {cluster: c, user: u}\n"
        "current-context: x\n"
    )
    creds = config.load(path)
    assert creds.endpoint.url == "https://10.0.0.1:6443"
    assert creds.ssl_context is not None and creds.ssl_context.verify_mode == ssl.CERT_NONE
    assert await creds.token() == "from-file"


async def test_token_file_is_reread_after_a_minute(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    source = TokenFile(path, clock=lambda: now[0])
    path.write_text("two")
    assert await source() == "one"
    now[0] = 61.0
    assert await source() == "two"
    path.unlink()  # while the kubelet swaps the file: keep the last token
    now[0] = 200.0
    assert await source() == "two"


async def test_exec_plugin_token_and_its_environment(tmp_path: Path) -> None:
    plugin = tmp_path / "plugin.py"
    plugin.write_text(
        "import json, os, sys\n"
        "info = json.loads(os.environ['KUBERNETES_EXEC_INFO'])\n"
        "print(json.dumps({'apiVersion': info['apiVersion'], 'kind': 'ExecCredential',"
        " 'status': {'token': os.environ['GREETING'] + '-' + sys.argv[1]}}))\n"
    )
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": sys.executable,
            "args": [str(plugin), "arg"],
            "env": [{"name": "GREETING", "value": "hi"}],
        }
    }
    creds = config.load(_kubeconfig(tmp_path, user))
    assert await creds.token() == "hi-arg"


async def test_exec_plugin_failure_names_the_plugin(tmp_path: Path) -> None:
    creds = config.load(_kubeconfig(tmp_path, {"exec": {"command": "false"}}))
    with pytest.raises(ConfigError, match="exec plugin 'false' failed"):
        await creds.token()


def test_client_certificate_data_and_ca(tmp_path: Path) -> None:
    # The system CA bundle stands in for a cluster CA; a good client certificate is what every cluster test's
    # admin kubeconfig carries (client-certificate-data), so only the refusal of a bad one is checked here.
    pem = Path(ssl.get_default_verify_paths().openssl_cafile or "")
    if not pem.is_file():
        pytest.skip("no system CA bundle to use as certificate-authority")
    cluster = {"server": "https://127.0.0.1:6443", "certificate-authority": str(pem)}
    creds = config.load(_kubeconfig(tmp_path, {"token": "t"}, cluster))
    assert creds.ssl_context is not None and creds.ssl_context.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ConfigError, match="client certificate and key"):
        bad = base64.b64encode(b"not a certificate").decode()
        config.load(_kubeconfig(tmp_path, {"client-certificate-data": bad, "client-key-data": bad}, cluster))


@pytest.mark.parametrize(
    ("user", "message"),
    [
        ({"auth-provider": {"name": "gcp"}}, "uses auth-provider, which is not supported"),
        ({"username": "a", "password": "b"}, "uses username"),
        ({"client-certificate-data": "!!"}, "client-certificate-data is not valid base64"),
    ],
)
def test_unusable_users_are_one_line_errors(tmp_path: Path, user: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config.load(_kubeconfig(tmp_path, user, {"server": "https://127.0.0.1:6443"}))


def test_missing_pieces(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read kubeconfig"):
        config.load(tmp_path / "absent")
    path = _kubeconfig(tmp_path, {"token": "t"})
    with pytest.raises(ConfigError, match="no context named 'other'"):
        config.load(path, context="other")


def _service_account(sa_dir: Path) -> None:
    (sa_dir / "token").write_text("sa-token")
    (sa_dir / "token").chmod(stat.S_IRUSR)
    pem = Path(ssl.get_default_verify_paths().openssl_cafile or "")
    if not pem.is_file():
        pytest.skip("no system CA bundle to stand in for the service account's ca.crt")
    (sa_dir / "ca.crt").write_bytes(pem.read_bytes())


async def test_in_cluster(tmp_path: Path) -> None:
    _service_account(tmp_path)
    creds = config.in_cluster(tmp_path, {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"})
    assert creds.endpoint.url == "https://[fd00::1]:443"
    assert await creds.token() == "sa-token"
    with pytest.raises(ConfigError, match="not in a cluster"):
        config.in_cluster(tmp_path, {})
