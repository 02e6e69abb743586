"""Each process's main and the CLI, run as processes: credentials they cannot use (a bad kubeconfig, a pod
without its service account token) and an apiserver that does not answer are one line naming the file, the
field or the address, never a traceback; ``KUBECONFIG=a:b`` is merged; and the in-pod path never imports
kubernetes-asyncio (its loader is for kubeconfigs alone); each process imports without the garbage collector
and freezes what its imports left (``computedomain.startup``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
PROCESSES = {
    "controller": ["-m", "computedomain", "controller"],
    "node agent": ["-m", "computedomain", "kubelet-plugin"],
    "daemon": ["-m", "imex", "daemon", "run"],
}
# The downward-API and CDI settings each process needs before it reaches the apiserver.
PROCESS_ENV = {
    "NODE_NAME": "n1",
    "POD_IP": "127.0.0.1",
    "POD_NAME": "p",
    "POD_NAMESPACE": "ns",
    "POD_UID": "u",
    "COMPUTE_DOMAIN_UUID": "0b0e5a6e-4f4b-4a8c-9a57-7b8e1f0c1a11",
}


def _run(argv: list[str], env: dict[str, str], timeout: float = 40) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}
    return subprocess.run(
        [sys.executable, *argv],
        env={**base, **PROCESS_ENV, **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _one_error_line(out: subprocess.CompletedProcess[str], *names: str) -> str:
    assert out.returncode != 0, out.stderr
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, out.stderr
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


def _kubeconfig(path: Path, server: str, **cluster: object) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return path


@pytest.mark.parametrize("process", PROCESSES)
def test_a_bad_kubeconfig_is_one_line_naming_the_file_and_field(tmp_path: Path, process: str) -> None:
    bad = _kubeconfig(tmp_path / "kc", "https://127.0.0.1:1", **{"insecure-skip-tls-verify": "false"})
    out = _run(PROCESSES[process], {"KUBECONFIG": str(bad)})
    _one_error_line(out, str(bad), "insecure-skip-tls-verify")


@pytest.mark.parametrize("process", PROCESSES)
def test_a_pod_without_its_token_is_one_line_naming_the_file(process: str) -> None:
    if Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        pytest.skip("this machine is a pod with a service account token")
    out = _run(PROCESSES[process], {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"})
    _one_error_line(out, "/var/run/secrets/kubernetes.io/serviceaccount/token")


def test_status_merges_kubeconfig_files_and_names_an_unreachable_apiserver(tmp_path: Path) -> None:
    """``KUBECONFIG=a:b computedomain status NAME``: the context in b, its cluster and user in a."""
    a = tmp_path / "a"
    a.write_text(
        json.dumps(
            {
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
            }
        )
    )
    b = tmp_path / "b"
    b.write_text(
        json.dumps({"contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}], "current-context": "x"})
    )
    out = _run(["-m", "computedomain", "status", "cd"], {"KUBECONFIG": f"{a}{os.pathsep}{b}"})
    _one_error_line(out, "127.0.0.1:1")


def test_status_with_a_bad_kubeconfig(tmp_path: Path) -> None:
    (tmp_path / "kc").write_text("clusters: [\n")
    out = _run(["-m", "computedomain", "status", "cd", "--kubeconfig", str(tmp_path / "kc")], {})
    _one_error_line(out, str(tmp_path / "kc"), "not YAML")


IN_POD = """
import resource, sys
from pathlib import Path
import computedomain.controller.app, computedomain.plugin.app, imex.daemon.run
from computedomain.kube.client import KubeClient
from computedomain.kube.config import in_cluster
sa = Path(sys.argv[1])
sa.joinpath("token").write_text("t")
sa.joinpath("ca.crt").write_text(Path(sys.argv[2]).read_text())
client = KubeClient(in_cluster(sa, {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}))
print(" ".join(m for m in sys.modules if m.split(".")[0] == "kubernetes_asyncio" or m == "computedomain.kube.kubeconfig"))
"""


def test_the_in_pod_path_never_imports_kubernetes_asyncio(tmp_path: Path) -> None:
    import ssl

    ca = ssl.get_default_verify_paths().openssl_cafile or ""
    if not Path(ca).is_file():
        pytest.skip("no system CA bundle to stand in for the service account's ca.crt")
    out = subprocess.run(
        [sys.executable, "-c", IN_POD, str(tmp_path), ca], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "", f"the in-pod path imported {out.stdout.strip()}"


# A process's `-m` entry run as `python -m` runs it. Prints the collections that began once the client stack
# (aiohttp) was being imported and before anything was frozen, what the collector holds frozen, and whether it
# is on.
UNDER_RUNPY = """
import gc, runpy, sys
during = []
gc.callbacks.append(lambda phase, info: phase == "start" and "aiohttp" in sys.modules
                    and gc.get_freeze_count() == 0 and during.append(info["generation"]))
module, sys.argv = sys.argv[1], sys.argv[1:]
code = 0
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print(len(during), gc.get_freeze_count(), gc.isenabled())
sys.exit(code)
"""


@pytest.mark.parametrize("process", PROCESSES)
def test_each_process_imports_without_the_collector_and_freezes_what_it_imported(process: str) -> None:
    """`computedomain.startup`: the imports' objects are in the permanent generation, the collector on again."""
    if Path("/var/run/secrets/kubernetes.io/serviceaccount/token").exists():
        pytest.skip("this machine is a pod with a service account token")
    argv = PROCESSES[process]
    out = _run(
        ["-c", UNDER_RUNPY, *argv[1:]], {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    )
    _one_error_line(out, "/var/run/secrets/kubernetes.io/serviceaccount/token")  # it got past its imports
    during, frozen, enabled = out.stdout.split()
    assert during == "0", f"{process}: {during} collections while it imported its modules"
    assert int(frozen) > 20_000, f"{process}: {frozen} objects frozen"
    assert enabled == "True"


def test_imports_without_gc_leaves_a_collector_that_was_off_off() -> None:
    script = (
        "import gc\nfrom computedomain.startup import imports_without_gc\ngc.disable()\n"
        "with imports_without_gc():\n    inside = gc.isenabled()\n    import json\n"
        "print(inside, gc.isenabled(), gc.get_freeze_count() > 0)"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "True"]
