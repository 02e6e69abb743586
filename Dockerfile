# The one image of the ComputeDomain service: the controller (`python -m computedomain controller`), the
# node agent (`python -m computedomain kubelet-plugin`), the IMEX daemon (`python -m imex daemon run|check`,
# which the controller runs in its per-domain DaemonSets with this same image) and the chart's uninstall
# hook. nvidia-imex and nvidia-imex-ctl are not in the image: the daemon finds them in the driver files
# the NVIDIA container runtime or the node agent's CDI spec provides.
#
#   docker build -t ghcr.io/computedomain/computedomain:0.1.0 .
#   make image        # the same image without Docker: tests/testbed/image.py reads this file and refuses
#                     # an instruction it does not reproduce, so keep to the ones it knows or teach it


# The base is pinned by tag (Python minor and Debian release, the same pair `make image` builds from Debian
# packages), not yet by digest: no digest has been checked against a registry for this file. A release build
# should pin both FROM lines to `python:3.11-slim-bookworm@sha256:<digest>`.
FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# Dependencies first (pinned in pyproject.toml), so code changes reuse this layer.
COPY pyproject.toml README.md ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']))" \
      > /tmp/requirements.txt \
 && python -m venv /opt/venv \
 && /opt/venv/bin/pip install -r /tmp/requirements.txt
COPY computedomain ./computedomain
COPY imex ./imex
RUN /opt/venv/bin/pip install --no-deps .

FROM python:3.11-slim-bookworm
# chroot (coreutils, already in the base image) runs nvidia-imex-ctl inside the driver root (node agent,
# hostManaged). No init: the pods' `command` replaces any entrypoint, and every process here handles
# SIGTERM itself and waits for its own children.
RUN groupadd --gid 65532 computedomain \
 && useradd --uid 65532 --gid 65532 --no-create-home --shell /usr/sbin/nologin computedomain
COPY --from=build /opt/venv /opt/venv
# Memory paid on every node (docs/design/0007): without PYDANTIC_DISABLE_PLUGINS the model library scans
# every installed package's metadata for plugins at its first model (we use none), and glibc would give each
# thread that allocates (asyncio.to_thread) an arena of its own; these processes allocate almost only on the
# event loop's thread, so one arena serves them. A fixed mmap threshold keeps every block of 128 KiB or more
# (each TLS connection's 256 KiB read buffer, large API answers) in a mapping of its own that goes back to the
# kernel when freed; glibc's moving threshold puts them in the heap after the first is freed, where the
# memory of closed connections stays (docs/design/0013). Start-up (docs/design/0013): the HTTP library builds
# two default TLS contexts when it is imported, each loading the system's whole CA bundle (about 90 ms of
# every process's start); these processes verify the apiserver against the service account's CA (or a
# kubeconfig's) only and never use them, so OpenSSL's default paths point at nothing. A deployment that needs a
# CA bundle of its own sets SSL_CERT_FILE in the chart's env.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYDANTIC_DISABLE_PLUGINS=__all__ \
    MALLOC_ARENA_MAX=1 \
    MALLOC_MMAP_THRESHOLD_=131072 \
    SSL_CERT_FILE=/dev/null \
    SSL_CERT_DIR=/dev/null
LABEL org.opencontainers.image.title="computedomain" \
      org.opencontainers.image.description="ComputeDomain controller, DRA node agent and IMEX daemon" \
      org.opencontainers.image.licenses="Apache-2.0"
# Non-root by default: the controller and the uninstall hook run as 65532. The two that need root say so
# in their pod specs (runAsUser: 0): the node agent (kubelet and CDI directories) and the IMEX daemon
# (the pod's /etc/hosts, /imexd, the fabric-imex-mgmt device); docs/security.md has the reasons.
USER 65532:65532
CMD ["python", "-m", "computedomain", "--help"]
