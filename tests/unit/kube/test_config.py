"""The in-cluster credentials: the service account's token (re-read once a minute, at once after a 401) and CA,
each with a one-line error for what is missing."""

from __future__ import annotations

import ssl
import stat
from pathlib import Path

import pytest

from computedomain.kube import config
from computedomain.kube.config import ConfigError, TokenFile

pytestmark = pytest.mark.timeout(10)


async def test_token_file_is_reread_after_a_minute(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "token"
    path.write_text("one")
    source = TokenFile(path, clock=lambda: now[0])
    path.write_text("two")
    assert await source.authorization() == "Bearer one"
    now[0] = 61.0
    assert await source.authorization() == "Bearer two"
    path.unlink()  # while the kubelet swaps the file: keep the last token
    now[0] = 200.0
    assert await source.authorization() == "Bearer two"


async def test_token_file_is_reread_at_once_after_a_401(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one")
    source = TokenFile(path, clock=lambda: 0.0)  # time stands still: only the 401 makes it read again
    assert await source.authorization() == "Bearer one"
    assert not await source.rejected("Bearer one"), "unchanged: nothing fresher to send"
    path.write_text("two")
    assert await source.authorization() == "Bearer one"
    assert await source.rejected("Bearer one")
    assert await source.authorization() == "Bearer two"
    assert await source.rejected("Bearer one"), "a 401 to a token already replaced: send again"


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
    assert creds.server == "https://[fd00::1]:443"
    assert creds.ssl_context is not None and creds.ssl_context.verify_mode == ssl.CERT_REQUIRED
    assert await creds.auth.authorization() == "Bearer sa-token"
    with pytest.raises(ConfigError, match="not in a cluster"):
        config.in_cluster(tmp_path, {})


def test_in_cluster_without_a_token_names_the_file(tmp_path: Path) -> None:
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    with pytest.raises(ConfigError, match=f"cannot read the token file {tmp_path}/token"):
        config.in_cluster(tmp_path, env)
    (tmp_path / "token").write_text("t")
    with pytest.raises(ConfigError, match=f"CA {tmp_path}/ca.crt is missing"):
        config.in_cluster(tmp_path, env)
