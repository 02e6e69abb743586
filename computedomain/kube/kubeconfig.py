"""Kubeconfigs, read by kubernetes-asyncio's loader: the CLI's and out-of-cluster runs' ``Credentials``.

What it owns: ``load(paths, context=)``: the files of ``paths`` (``KUBECONFIG``'s form, ``a:b``) merged as
kubectl merges them (the first file that names a cluster, user or context wins; the last
``current-context`` set wins), the context chosen, and kubernetes-asyncio's ``KubeConfigLoader`` run on it:
certificate authorities and client certificates (files or ``-data``), ``token``, ``tokenFile``, exec
credential plugins (token or client-certificate output), OIDC and GCP auth providers, ``proxy-url``,
``tls-server-name`` and server URLs with a path prefix. Its ``Configuration`` is what the API client's
aiohttp session is built from (the TLS context from its CA, certificate and key; the ``Authorization`` header
from its api key; its proxy), the way kopf borrows credentials from it.

What is checked here before the loader runs, as client-go checks it: ``insecure-skip-tls-verify`` must be a
boolean (the string ``"false"`` would read as true), and it may not sit next to a certificate authority; the
cluster must name a server; a proxy must be ``http`` or ``https`` (aiohttp has no SOCKS).

Credentials that expire are renewed: a token from an exec plugin or an OIDC provider shortly before it
expires (the loader's own skew, five minutes), an exec plugin's client certificate likewise (the plugin is
run here for it: the loader keeps no expiry for a certificate; the session then connects with the new one),
every credential at once after the apiserver answered 401 to it; a ``tokenFile`` is re-read once a minute
(``config.TokenFile``).

Importing this module imports kubernetes-asyncio (about 1,260 modules, 70 MiB): only ``config.load`` does,
and only when a kubeconfig is used; a process in a pod never does.

Failures are ``config.ConfigError``: one line naming the file(s), the field and what to do.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio.client import Configuration
from kubernetes_asyncio.config.config_exception import ConfigException
from kubernetes_asyncio.config.dateutil import parse_rfc3339
from kubernetes_asyncio.config.exec_provider import ExecProvider
from kubernetes_asyncio.config.kube_config import (
    EXPIRY_SKEW_PREVENTION_DELAY,
    KubeConfigLoader,
    KubeConfigMerger,
)

from computedomain.kube.config import Auth, ConfigError, Credentials, NoAuth, StaticToken, TokenFile, tls_context

__all__ = ["load"]

#: how often a renewable credential is asked whether it is about to expire
_RENEW_CHECK_S = 60.0
_PROXY_SCHEMES = ("http", "https")


class _LoaderAuth:
    tls: ssl.SSLContext | None = None
    """A credential the loader renews (exec plugins, auth providers): asked again every ``_RENEW_CHECK_S``
    (the loader renews only what is about to expire) and at once after a 401."""

    def __init__(self, loader: KubeConfigLoader, configuration: Configuration) -> None:
        self._loader = loader
        self._header: str | None = configuration.api_key.get("BearerToken")
        self._checked = time.monotonic()
        self._expires = hasattr(loader, "exec_plugin_expiry") or loader.provider is not None

    async def _renew(self, *, force: bool) -> None:
        if force and hasattr(self._loader, "exec_plugin_expiry"):
            del self._loader.exec_plugin_expiry  # the loader re-runs the plugin only once this is gone
        if force or self._expires:
            try:
                await self._loader._load_authentication()
            except (ConfigException, OSError, ValueError) as exc:
                raise ConfigError(f"cannot renew the kubeconfig credential: {exc}") from None
            self._header = getattr(self._loader, "token", self._header)
        self._checked = time.monotonic()

    async def authorization(self) -> str | None:
        if self._expires and time.monotonic() - self._checked >= _RENEW_CHECK_S:
            await self._renew(force=False)
        return self._header

    async def rejected(self, authorization: str | None) -> bool:
        if authorization != self._header:
            return True
        await self._renew(force=True)
        return self._header != authorization


def _where(paths: str) -> str:
    return f"kubeconfig {paths}"


def _merge(paths: str) -> KubeConfigMerger:
    existing = [p for p in paths.split(os.pathsep) if p and Path(p).expanduser().exists()]
    if not existing:
        raise ConfigError(
            f"no kubeconfig at {paths}: set KUBECONFIG or --kubeconfig to a kubeconfig file, or run in a pod"
        )
    try:
        merger = KubeConfigMerger(paths)
    except OSError as exc:
        raise ConfigError(f"cannot read {_where(paths)}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{_where(paths)} is not YAML: {' '.join(str(exc).split())}") from None
    except (TypeError, AttributeError, KeyError):
        raise ConfigError(f"{_where(paths)}: every file must be a mapping with clusters, contexts and users") from None
    return merger


def _check_cluster(cluster: Any, where: str) -> None:
    """What client-go refuses and kubernetes-asyncio's loader would let through."""
    if not isinstance(cluster, dict):
        raise ConfigError(f"{where}: the cluster is not a mapping")
    if not cluster.get("server"):
        raise ConfigError(f"{where}: the cluster has no server; set clusters[].cluster.server")
    insecure = cluster.get("insecure-skip-tls-verify", False)
    if not isinstance(insecure, bool):
        raise ConfigError(
            f"{where}: insecure-skip-tls-verify must be true or false, not {insecure!r} (remove the quotes)"
        )
    if insecure and (cluster.get("certificate-authority") or cluster.get("certificate-authority-data")):
        raise ConfigError(
            f"{where}: insecure-skip-tls-verify next to a certificate authority is not allowed; remove one of them"
        )
    proxy = str(cluster.get("proxy-url") or "")
    if proxy and proxy.partition("://")[0] not in _PROXY_SCHEMES:
        raise ConfigError(f"{where}: proxy-url {proxy!r} is not supported; use an http:// or https:// proxy")


def _tls_from_pem(cert: str, key: str, ca_file: str | None, verify: bool) -> ssl.SSLContext:
    with tempfile.TemporaryDirectory(prefix="cd-exec-") as tmp:  # ssl reads a certificate chain from files only
        cert_file, key_file = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        cert_file.write_text(cert)
        key_file.write_text(key)
        return tls_context(ca_file=ca_file, cert_file=str(cert_file), key_file=str(key_file), verify=verify)


class _ExecCertificate:
    """An exec plugin's client certificate (``clientCertificateData``/``clientKeyData``), run again
    ``EXPIRY_SKEW`` before its ``expirationTimestamp`` and at once after a 401; the loader keeps no expiry for
    a certificate, so the plugin is run here with kubernetes-asyncio's ``ExecProvider``."""

    def __init__(self, exec_config: Any, configuration: Configuration, where: str) -> None:
        self._exec = exec_config
        self._ca = configuration.ssl_ca_cert
        self._verify = bool(configuration.verify_ssl)
        self._where = where
        self._renew_at: float | None = None
        self.tls: ssl.SSLContext | None = None

    async def run(self) -> None:
        try:
            status = await ExecProvider(self._exec).run()
        except (ConfigException, OSError) as exc:
            raise ConfigError(f"{self._where}: {exc}") from None
        cert, key = status.get("clientCertificateData"), status.get("clientKeyData")
        if not cert or not key:
            raise ConfigError(f"{self._where}: the exec plugin returned a certificate without a key, or no certificate")
        self.tls = _tls_from_pem(str(cert), str(key), self._ca, self._verify)
        self._renew_at = None
        if status.get("expirationTimestamp"):
            expiry = parse_rfc3339(status["expirationTimestamp"]) - EXPIRY_SKEW_PREVENTION_DELAY
            self._renew_at = expiry.timestamp()

    async def authorization(self) -> str | None:
        if self._renew_at is not None and time.time() >= self._renew_at:
            await self.run()
        return None

    async def rejected(self, authorization: str | None) -> bool:
        await self.run()
        return True


def _resolve_exec_command(loader: KubeConfigLoader) -> None:
    """An exec plugin's relative command with a path separator is relative to the kubeconfig that names it (as
    in client-go); kubernetes-asyncio's ``ExecProvider`` would look it up from the working directory."""
    user = loader._user
    exec_config = user.value.get("exec") if user is not None and isinstance(user.value, dict) else None
    if not isinstance(exec_config, dict) or user is None or not user.path:
        return
    command = str(exec_config.get("command") or "")
    if os.sep in command and not Path(command).is_absolute():
        exec_config["command"] = str(Path(user.path).absolute().parent / command)


def _auth(loader: KubeConfigLoader, configuration: Configuration, where: str) -> Auth:
    user = loader._user.value if loader._user is not None else {}
    if loader._user is not None and "exec" in user and not configuration.api_key.get("BearerToken"):
        return _ExecCertificate(loader._user["exec"], configuration, where)
    if loader.provider is not None or "exec" in user:
        return _LoaderAuth(loader, configuration)
    if user.get("tokenFile") and not user.get("token"):
        base = loader._get_base_path(loader._user.path if loader._user is not None else None)
        return TokenFile(Path(base, str(user["tokenFile"])))
    header = configuration.api_key.get("BearerToken")
    if not header:
        return NoAuth()
    if not str(header).startswith("Bearer "):
        return _Header(str(header))
    return StaticToken(str(header).removeprefix("Bearer "))


class _Header(StaticToken):
    """Any other fixed ``Authorization`` header the loader made (basic auth)."""

    def __init__(self, header: str) -> None:
        self._header = header


async def load(paths: str, *, context: str | None = None) -> Credentials:
    """The credentials of ``context`` (else the current context) of the kubeconfig files ``paths``."""
    merger = _merge(paths)
    where = _where(paths)
    if context is None:
        # kubectl: the first file that sets current-context wins (the merger keeps the last one).
        context = next(
            (str(c["current-context"]) for c in merger.config_files.values() if c.get("current-context")), None
        )
    if context is None:
        raise ConfigError(f"{where} has no current-context; set one (kubectl config use-context) or pass a context")
    try:
        loader = KubeConfigLoader(config_dict=merger.config, active_context=context, config_base_path=None)
    except ConfigException as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (AssertionError, TypeError, KeyError):
        raise ConfigError(f"{where}: context {context} names no cluster") from None
    where = f"{where}, context {context}"
    assert loader._cluster is not None
    _check_cluster(loader._cluster.value, where)
    _resolve_exec_command(loader)
    configuration = Configuration()
    try:
        await loader.load_and_set(configuration)
    except (ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from None
    server = str(configuration.host).rstrip("/")
    auth = _auth(loader, configuration, where)
    if isinstance(auth, _ExecCertificate):
        await auth.run()
    ctx = None
    if server.startswith("https://"):
        ctx = tls_context(
            ca_file=configuration.ssl_ca_cert,
            cert_file=configuration.cert_file,
            key_file=configuration.key_file,
            verify=bool(configuration.verify_ssl),
        )
    return Credentials(
        server,
        ctx,
        auth,
        server_hostname=configuration.tls_server_name or None,
        proxy=configuration.proxy or None,
        source=where,
    )
