"""`make image` and the Dockerfile describe one image: the builder reads the Dockerfile and refuses what it
cannot reproduce, and the OCI archive it writes is what containerd's importer expects (no build here)."""

from __future__ import annotations

import gzip
import hashlib
import json
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.testbed.image import (
    DOCKERFILE,
    REPO,
    DockerfileError,
    dependencies,
    image_name,
    parse_dockerfile,
    runtime_env,
)
from tests.testbed.oci import ImageConfig, write_archive, write_layer


def test_the_dockerfile_is_the_image_the_builder_makes() -> None:
    spec = parse_dockerfile(DOCKERFILE.read_text())
    assert spec.python == "3.11"
    assert (spec.user, spec.uid, spec.gid) == ("computedomain", 65532, 65532)
    assert spec.run_as == f"{spec.uid}:{spec.gid}"  # non-root by default; the chart says where root is needed
    assert spec.venv == "/opt/venv"
    assert spec.env["PATH"].startswith("/opt/venv/bin:")
    assert spec.env["PYTHONUNBUFFERED"] == "1"
    assert spec.cmd == ["python", "-m", "computedomain", "--help"]
    assert spec.installs_pyproject_dependencies and spec.installs_project_without_deps


def test_the_chart_runs_the_controller_as_the_images_user() -> None:
    spec = parse_dockerfile(DOCKERFILE.read_text())
    values = yaml.safe_load((REPO / "manifests" / "helm" / "compute-domain" / "values.yaml").read_text())
    context = values["controller"]["podSecurityContext"]
    assert (context["runAsUser"], context["runAsGroup"]) == (spec.uid, spec.gid)


def test_one_list_of_dependencies() -> None:
    with (REPO / "pyproject.toml").open("rb") as handle:
        assert dependencies() == tomllib.load(handle)["project"]["dependencies"]
    # Neither the Dockerfile nor the builder names a dependency itself.
    for source in (DOCKERFILE, REPO / "tests" / "testbed" / "image.py"):
        text = source.read_text()
        assert not [d for d in dependencies() if d.split("==")[0] in text], source


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: t.replace("CMD [", 'ENTRYPOINT ["tini"]\nCMD ['), "ENTRYPOINT"),
        (lambda t: t.replace("FROM python:3.11-slim-bookworm\n", "FROM python:3.12-slim\n"), "python 3.12"),
        (lambda t: t.replace("FROM python:3.11-slim-bookworm\n", "FROM python:3.11-slim-trixie\n"), "bookworm"),
        (lambda t: t + "\nRUN apt-get install -y curl\n", "RUN"),
        (lambda t: t + "\nUSER computedomain\n", "USER"),
        (lambda t: t.replace("COPY --from=build /opt/venv /opt/venv", "COPY --from=build /opt/venv /venv"), "COPY"),
        (lambda t: t.replace("/opt/venv/bin/pip install --no-deps .", "/opt/venv/bin/pip install ."), "--no-deps"),
        (lambda t: t.replace('CMD ["python", "-m", "computedomain", "--help"]', "CMD python -m computedomain"), "JSON"),
    ],
)
def test_a_dockerfile_change_the_builder_does_not_reproduce_is_refused(change: object, message: str) -> None:
    text = change(DOCKERFILE.read_text())  # type: ignore[operator]
    with pytest.raises(DockerfileError, match=message):
        parse_dockerfile(text)


def test_the_image_is_named_as_the_chart_renders_it() -> None:
    assert image_name() == "ghcr.io/computedomain/computedomain:0.1.0"


def test_the_oci_archive_is_a_valid_layout(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "bin").mkdir(parents=True)
    (tree / "bin" / "hello").write_text("#!/bin/sh\necho hi\n")
    (tree / "bin" / "hello").chmod(0o755)
    (tree / "bin" / "again").hardlink_to(tree / "bin" / "hello")
    (tree / "dev").mkdir()
    (tree / "dev" / "null-ish").write_text("left out")
    layer = write_layer(tree, tmp_path / "layer.tar.gz", prefix="opt/app")
    blob = (tmp_path / "layer.tar.gz").read_bytes()
    assert layer.digest == f"sha256:{hashlib.sha256(blob).hexdigest()}"
    assert layer.diff_id == f"sha256:{hashlib.sha256(gzip.decompress(blob)).hexdigest()}"
    with tarfile.open(tmp_path / "layer.tar.gz") as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert {"opt", "opt/app", "opt/app/bin/hello", "opt/app/dev"} <= set(members)
    assert "opt/app/dev/null-ish" not in members
    assert members["opt/app/bin/hello"].mode & 0o111
    assert members["opt/app/bin/again"].islnk() or members["opt/app/bin/hello"].islnk()

    archive = tmp_path / "image.tar"
    write_archive(archive, "example.test/app:1", [layer], ImageConfig(env=["A=1"], cmd=["hello"], user="65532"))
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        descriptor = index["manifests"][0]
        assert descriptor["annotations"]["io.containerd.image.name"] == "example.test/app:1"
        manifest = json.load(tar.extractfile(f"blobs/sha256/{descriptor['digest'][7:]}"))  # type: ignore[arg-type]
        config = json.load(tar.extractfile(f"blobs/sha256/{manifest['config']['digest'][7:]}"))  # type: ignore[arg-type]
    assert "oci-layout" in names and f"blobs/sha256/{layer.digest[7:]}" in names
    assert manifest["layers"] == [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                                   "digest": layer.digest, "size": layer.size}]  # fmt: skip
    assert config["rootfs"]["diff_ids"] == [layer.diff_id]
    assert config["config"] == {"Env": ["A=1"], "Cmd": ["hello"], "User": "65532", "WorkingDir": "/"}


def test_the_benchmarks_run_our_processes_with_the_images_own_environment() -> None:
    env = runtime_env()
    assert env["MALLOC_ARENA_MAX"] == "1" and env["PYDANTIC_DISABLE_PLUGINS"] == "__all__"
    assert "PATH" not in env and "LANG" not in env  # the base image's, and the venv's path: not for a process here
