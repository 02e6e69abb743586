"""Where the apiserver is and how to prove who we are: in-cluster service account or a kubeconfig.

What it owns: ``load`` (``kubeconfig`` path -> that file; else in-cluster when ``KUBERNETES_SERVICE_HOST`` is
set; else ``$KUBECONFIG``'s first entry or ``~/.kube/config``) and the ``Credentials`` it returns: the
``transport.Endpoint``, the TLS context (cluster CA, client certificate) and a bearer-token source.

Supported, as client-go reads them: the in-cluster service account (the token file is re-read once a minute,
because the kubelet rotates bound tokens); kubeconfig clusters with ``server``, ``certificate-authority`` or
``-data``, ``insecure-skip-tls-verify``, ``tls-server-name``; users with ``client-certificate``/``-key`` (or
``-data``), ``token``, ``tokenFile``, and ``exec`` credential plugins (``client.authentication.k8s.io`` v1 and
v1beta1, token credentials; re-run when the credential expires). Relative paths are relative to the
kubeconfig's directory, as in kubectl. Anything else (basic auth, legacy ``auth-provider`` plugins, proxies)
is a ``ConfigError`` that says what is unsupported; the processes of this service run in-cluster.

A kubeconfig is JSON or YAML; JSON (what the test bed and most tools write) is read without importing a YAML
parser.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import os
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Final

from computedomain.kube.transport import Endpoint

__all__ = ["ConfigError", "Credentials", "load"]

SERVICE_ACCOUNT_DIR: Final = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: how long a token read from a file is used before the file is read again (client-go: one minute)
TOKEN_FILE_REFRESH_S: Final = 60.0
#: an exec credential is renewed this long before it expires
EXEC_EXPIRY_MARGIN_S: Final = 10.0
EXEC_TIMEOUT_S: Final = 60.0

TokenSource = Callable[[], Awaitable[str | None]]


class ConfigError(Exception):
    """The credentials cannot be loaded; the message names the file, the field and what to do."""


@dataclass(frozen=True)
class Credentials:
    endpoint: Endpoint
    ssl_context: ssl.SSLContext | None
    token: TokenSource


async def _no_token() -> str | None:
    return None


def _static(token: str) -> TokenSource:
    async def source() -> str | None:
        return token

    return source


class TokenFile:
    """A bearer token read from a file, re-read every ``TOKEN_FILE_REFRESH_S`` (rotated bound tokens)."""

    def __init__(self, path: Path, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._token = ""
        self._read_at: float | None = None
        self._read()

    def _read(self) -> None:
        try:
            token = self.path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {self.path}: {exc.strerror or exc}") from None
        if not token:
            raise ConfigError(f"the token file {self.path} is empty")
        self._token, self._read_at = token, self._clock()

    async def __call__(self) -> str | None:
        if self._read_at is None or self._clock() - self._read_at >= TOKEN_FILE_REFRESH_S:
            with contextlib.suppress(ConfigError):  # keep the last token while the file is being replaced
                self._read()
        return self._token


class ExecCredential:
    """A token from an exec credential plugin, run again shortly before the token expires."""

    def __init__(self, spec: Mapping[str, Any], *, base_dir: Path) -> None:
        command = spec.get("command")
        if not isinstance(command, str) or not command:
            raise ConfigError("kubeconfig user exec: command is missing")
        self.api_version = str(spec.get("apiVersion") or "client.authentication.k8s.io/v1")
        path = Path(command)
        self.argv = [str(base_dir / path) if os.sep in command and not path.is_absolute() else command]
        self.argv += [str(a) for a in spec.get("args") or ()]
        self.env = {**os.environ}
        for item in spec.get("env") or ():
            if isinstance(item, Mapping) and item.get("name"):
                self.env[str(item["name"])] = str(item.get("value") or "")
        self.env["KUBERNETES_EXEC_INFO"] = json.dumps(
            {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": {"interactive": False}}
        )
        self._token: str | None = None
        self._expires: float | None = None
        self._lock = asyncio.Lock()

    async def __call__(self) -> str | None:
        async with self._lock:
            if self._token is None or (self._expires is not None and time.time() >= self._expires):
                self._token, self._expires = await self._run()
            return self._token

    async def _run(self) -> tuple[str, float | None]:
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.argv,
                env=self.env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise ConfigError(f"kubeconfig exec plugin {self.argv[0]!r} cannot run: {exc.strerror or exc}") from None
        try:
            async with asyncio.timeout(EXEC_TIMEOUT_S):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise ConfigError(
                f"kubeconfig exec plugin {self.argv[0]!r} did not answer in {EXEC_TIMEOUT_S:g}s"
            ) from None
        if proc.returncode != 0:
            raise ConfigError(
                f"kubeconfig exec plugin {self.argv[0]!r} failed (exit {proc.returncode}): "
                f"{err.decode(errors='replace').strip()[:300]}"
            )
        try:
            status = json.loads(out)["status"]
            token = str(status["token"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError(
                f"kubeconfig exec plugin {self.argv[0]!r} returned no ExecCredential with status.token "
                "(client-certificate credentials from exec plugins are not supported)"
            ) from None
        expires: float | None = None
        if status.get("expirationTimestamp"):
            try:
                stamp = datetime.fromisoformat(str(status["expirationTimestamp"]).replace("Z", "+00:00"))
                expires = stamp.timestamp() - EXEC_EXPIRY_MARGIN_S
            except ValueError:
                expires = None
        return token, expires


def _b64(value: Any, what: str) -> bytes:
    try:
        return base64.b64decode(str(value), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"kubeconfig {what} is not valid base64") from None


def _ssl_context(
    *,
    ca_file: Path | None = None,
    ca_data: bytes | None = None,
    cert: bytes | Path | None = None,
    key: bytes | Path | None = None,
    insecure: bool = False,
) -> ssl.SSLContext:
    try:
        ctx = ssl.create_default_context(
            cafile=str(ca_file) if ca_file else None, cadata=ca_data.decode() if ca_data else None
        )
    except (OSError, ssl.SSLError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot load the cluster CA ({ca_file or 'certificate-authority-data'}): {exc}") from None
    if insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert is not None or key is not None:
        if cert is None or key is None:
            raise ConfigError("kubeconfig user has a client certificate without a key, or a key without one")
        with contextlib.ExitStack() as stack:
            paths = []
            for part in (cert, key):
                if isinstance(part, Path):
                    paths.append(str(part))
                    continue
                # ssl loads a certificate chain only from files: a private file, removed once loaded.
                fd, name = tempfile.mkstemp(prefix="cd-kube-", suffix=".pem")
                stack.callback(os.unlink, name)
                with os.fdopen(fd, "wb") as f:
                    f.write(part)
                paths.append(name)
            try:
                ctx.load_cert_chain(paths[0], paths[1])
            except (OSError, ssl.SSLError) as exc:
                raise ConfigError(f"cannot load the client certificate and key: {exc}") from None
    return ctx


def in_cluster(sa_dir: Path = SERVICE_ACCOUNT_DIR, env: Mapping[str, str] = os.environ) -> Credentials:
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        raise ConfigError("not in a cluster: KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT must be set")
    token = TokenFile(sa_dir / "token")
    ctx = _ssl_context(ca_file=sa_dir / "ca.crt")
    h = f"[{host}]" if ":" in host else host
    return Credentials(Endpoint.parse(f"https://{h}:{port}"), ctx, token)


def _read_kubeconfig(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read kubeconfig {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except ValueError:
        import yaml  # only for YAML kubeconfigs: JSON ones never load the parser

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"kubeconfig {path} is neither JSON nor YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"kubeconfig {path} is not a mapping")
    return data


def _named(data: Mapping[str, Any], section: str, name: str, path: Path) -> Mapping[str, Any]:
    for item in data.get(section) or ():
        if isinstance(item, Mapping) and item.get("name") == name:
            value = item.get(section[:-1])
            return value if isinstance(value, Mapping) else {}
    raise ConfigError(f"kubeconfig {path}: no {section[:-1]} named {name!r}")


def from_kubeconfig(path: Path, context: str | None = None) -> Credentials:
    data = _read_kubeconfig(path)
    ctx_name = context or str(data.get("current-context") or "")
    if not ctx_name:
        raise ConfigError(f"kubeconfig {path} has no current-context; pass a context")
    ctx = _named(data, "contexts", ctx_name, path)
    cluster = _named(data, "clusters", str(ctx.get("cluster") or ""), path)
    user = _named(data, "users", str(ctx.get("user") or ""), path) if ctx.get("user") else {}
    base = path.parent

    def file(value: Any) -> Path:
        p = Path(str(value))
        return p if p.is_absolute() else base / p

    server = str(cluster.get("server") or "")
    if not server:
        raise ConfigError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no server")
    if cluster.get("proxy-url"):
        raise ConfigError(f"kubeconfig {path}: proxy-url is not supported")
    try:
        endpoint = Endpoint.parse(server, server_name=str(cluster.get("tls-server-name") or ""))
    except ValueError as exc:
        raise ConfigError(f"kubeconfig {path}: {exc}") from None
    for unsupported in ("auth-provider", "username", "password"):
        if user.get(unsupported):
            raise ConfigError(
                f"kubeconfig {path}: user {ctx.get('user')!r} uses {unsupported}, which is not supported; "
                "use a token, a client certificate or an exec credential plugin"
            )
    cert: bytes | Path | None = None
    key: bytes | Path | None = None
    if user.get("client-certificate-data"):
        cert = _b64(user["client-certificate-data"], "client-certificate-data")
    elif user.get("client-certificate"):
        cert = file(user["client-certificate"])
    if user.get("client-key-data"):
        key = _b64(user["client-key-data"], "client-key-data")
    elif user.get("client-key"):
        key = file(user["client-key"])
    ssl_context: ssl.SSLContext | None = None
    if endpoint.scheme == "https":
        ssl_context = _ssl_context(
            ca_file=file(cluster["certificate-authority"]) if cluster.get("certificate-authority") else None,
            ca_data=_b64(cluster["certificate-authority-data"], "certificate-authority-data")
            if cluster.get("certificate-authority-data")
            else None,
            cert=cert,
            key=key,
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
        )
    token: TokenSource = _no_token
    if user.get("token"):
        token = _static(str(user["token"]))
    elif user.get("tokenFile"):
        token = TokenFile(file(user["tokenFile"]))
    elif isinstance(user.get("exec"), Mapping):
        token = ExecCredential(user["exec"], base_dir=base)
    return Credentials(endpoint, ssl_context, token)


def load(kubeconfig: Path | str | None = None, *, context: str | None = None) -> Credentials:
    """``kubeconfig`` wins; else in-cluster when ``KUBERNETES_SERVICE_HOST`` is set; else the default file."""
    if kubeconfig is not None:
        return from_kubeconfig(Path(kubeconfig), context)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        return in_cluster()
    first = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0]
    return from_kubeconfig(Path(first) if first else Path.home() / ".kube" / "config", context)
