"""Where the apiserver is and how to prove who we are: the ``Credentials`` the API client's session is built from.

What it owns: ``load`` (``kubeconfig`` path -> that file; else the in-cluster service account when
``KUBERNETES_SERVICE_HOST`` is set; else ``$KUBECONFIG`` or ``~/.kube/config``), the in-cluster loader, and
the bearer-token sources (``Auth``) the client asks before every request and tells about every 401.

Two paths, because they cost very different amounts:

* In a pod (every process of the service): the service account the kubelet mounts, read here: the CA
  (``ca.crt``) and the token, which the kubelet rotates. The token is re-read once a minute, as client-go's
  file token source does, and at once after the apiserver answered 401 to it (client-go drops a rejected
  token at once too); the rejected request is sent again once when the re-read token differs.
* Out of a pod (the CLI, a process started by hand, the test bed): a kubeconfig, loaded by
  ``computedomain.kube.kubeconfig`` with kubernetes-asyncio's loader, imported only on this path: importing
  kubernetes-asyncio costs a process about 1,260 modules and 70 MiB, which a pod never needs.

Proxies: ``HTTPS_PROXY``/``HTTP_PROXY`` and ``NO_PROXY`` are honoured as aiohttp's ``trust_env`` reads them
(``proxy_from_env``), once, when the client starts: the apiserver's address never changes. A kubeconfig's
``proxy-url`` wins over the environment, as in client-go.

Failures are ``ConfigError``: one line naming the file and the field, and what to do.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

__all__ = ["Auth", "ConfigError", "Credentials", "StaticToken", "TokenFile", "in_cluster", "load", "proxy_from_env"]

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: how long a token read from a file is used before the file is read again (client-go: one minute)
TOKEN_FILE_REFRESH_S: Final = 60.0


class ConfigError(Exception):
    """The credentials cannot be loaded; the message names the file, the field and what to do."""


class Auth(Protocol):
    """The ``Authorization`` header of the next request, and what to do when the apiserver refused one.

    ``tls``: a TLS context with a client certificate of the credential's own (an exec plugin's), used instead
    of the ``Credentials``' context while it is set."""

    tls: ssl.SSLContext | None

    async def authorization(self) -> str | None: ...

    async def rejected(self, authorization: str | None) -> bool:
        """The apiserver answered 401 to ``authorization``: drop it; True when the next one differs."""
        ...


class NoAuth:
    tls: ssl.SSLContext | None = None

    async def authorization(self) -> str | None:
        return None

    async def rejected(self, authorization: str | None) -> bool:
        return False


NO_AUTH: Final = NoAuth()


class StaticToken:
    """A bearer token that never changes (a kubeconfig's ``token``)."""

    tls: ssl.SSLContext | None = None

    def __init__(self, token: str) -> None:
        self._header = f"Bearer {token}"

    async def authorization(self) -> str | None:
        return self._header

    async def rejected(self, authorization: str | None) -> bool:
        return False


class TokenFile:
    """A bearer token read from a file: again every ``TOKEN_FILE_REFRESH_S`` and at once after a 401."""

    tls: ssl.SSLContext | None = None

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._header = ""
        self._read_at = 0.0
        self._read()

    def _read(self) -> None:
        try:
            token = self.path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {self.path}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"the token file {self.path} is empty")
        self._header, self._read_at = f"Bearer {token}", self._clock()

    async def authorization(self) -> str | None:
        if self._clock() - self._read_at >= TOKEN_FILE_REFRESH_S:
            with contextlib.suppress(ConfigError):  # keep the last token while the file is being replaced
                self._read()
        return self._header

    async def rejected(self, authorization: str | None) -> bool:
        if authorization != self._header:
            return True  # already replaced since that request went out
        with contextlib.suppress(ConfigError):
            self._read()
        return self._header != authorization


@dataclass(frozen=True)
class Credentials:
    """Everything the API client's session needs: where, which TLS, which ``Authorization`` and which proxy."""

    #: ``https://host:port`` and any path prefix the apiserver sits under (no trailing slash)
    server: str
    ssl_context: ssl.SSLContext | None = None
    auth: Auth = NO_AUTH
    #: the name the server certificate is checked against when it is not the server's host (tls-server-name)
    server_hostname: str | None = None
    #: a proxy for every request (kubeconfig proxy-url); None: the environment's (``proxy_from_env``)
    proxy: str | None = None
    #: where these came from, for error lines ("kubeconfig a:b, context kind", "the in-cluster service account")
    source: str = ""


def tls_context(
    *, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None, verify: bool = True
) -> ssl.SSLContext:
    """The client's TLS context: the cluster CA (else the system's), an optional client certificate."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the cluster CA {ca_file}: {exc}") from None
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert_file or key_file:
        if not cert_file or not key_file:
            raise ConfigError("the user has a client certificate without a key, or a key without a certificate")
        try:
            ctx.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load the client certificate {cert_file} and key {key_file}: {exc}") from None
    return ctx


def proxy_from_env(server: str) -> str | None:
    """The proxy ``HTTPS_PROXY``/``HTTP_PROXY`` name for ``server`` unless ``NO_PROXY`` exempts it (aiohttp's
    own reading of the environment, which its ``trust_env`` does on every request)."""
    from aiohttp.helpers import get_env_proxy_for_url
    from yarl import URL

    try:
        proxy, _ = get_env_proxy_for_url(URL(server))
    except LookupError:
        return None
    return str(proxy)


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR, env: Mapping[str, str] = os.environ) -> Credentials:
    """The service account the kubelet mounted into this pod (``sa_dir``: token, ca.crt)."""
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ConfigError("not in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be set")
    token = TokenFile(sa_dir / "token")
    ca = sa_dir / "ca.crt"
    if not ca.is_file():
        raise ConfigError(f"the service account's CA {ca} is missing (automountServiceAccountToken: false?)")
    h = f"[{host}]" if ":" in host else host
    return Credentials(
        f"https://{h}:{port}", tls_context(ca_file=str(ca)), token, source=f"the service account in {sa_dir}"
    )


async def load(kubeconfig: Path | str | None = None, *, context: str | None = None) -> Credentials:
    """``kubeconfig`` wins (a path, or several joined by ``:`` as in ``KUBECONFIG``); else in-cluster when
    ``KUBERNETES_SERVICE_HOST`` is set; else ``$KUBECONFIG`` or ``~/.kube/config``."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    # Only here: a pod never pays for the kubeconfig loader (see the module docstring).
    from computedomain.kube import kubeconfig as kubeconfig_loader

    paths = str(kubeconfig) if kubeconfig else os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    return await kubeconfig_loader.load(paths, context=context)
