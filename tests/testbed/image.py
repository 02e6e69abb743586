"""`make image`: the project's one image as an OCI image archive, built without a Docker engine or a registry.

    python -m tests.testbed.image            build what is missing; print the archive's path, name and size
    python -m tests.testbed.image --print    print the archive's path (building it when missing), nothing else

The `Dockerfile` stays the description of the image; this builder reads it and refuses one it does not
understand, so the two cannot drift apart (a unit test builds nothing and checks exactly that):
- the final stage's `FROM python:X.Y-slim` names the Python minor version: the base layer is Debian's
  python3 of that version (bookworm: 3.11), laid out by `mmdebstrap --variant=minbase`;
- its `RUN groupadd ... useradd ...` gives the non-root user (name, uid, gid, shell) written into
  /etc/passwd and /etc/group; its `COPY --from=build <venv> <venv>` names the virtual environment;
- its `ENV`, `LABEL` and `CMD` become the image config;
- the build stage must install `pyproject.toml`'s `[project] dependencies` (the one list of what goes in)
  and then the project with `--no-deps`; here the dependencies come as wheels from PyPI
  (`pip install --only-binary=:all: --target`) and the project is built from this checkout.

Three layers, each cached under `${XDG_CACHE_HOME:-~/.cache}/computedomain/image/` by a digest of its own
inputs, so a code change repacks only the small project layer: base (Debian, the user), dependencies (the
venv with the wheels), project (computedomain, imex, their entry points). Each layer's tree stays
unpacked in the cache too: the real-node test bed stacks them as the lower layers of each
node's fake driver root (the Python and the `imex` package that run the IMEX simulator there).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.testbed.oci import ImageConfig, Layer, write_archive, write_layer

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
CHART = REPO / "manifests" / "helm" / "compute-domain"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "computedomain" / "image"
PRUNE_DAYS = 5

# The Debian release whose python3 has each minor version the Dockerfile may name.
DEBIAN_FOR_PYTHON = {"3.11": "bookworm"}
DEBIAN_MIRRORS = (
    "deb http://deb.debian.org/debian {suite} main",
    "deb http://deb.debian.org/debian {suite}-updates main",
    "deb http://deb.debian.org/debian-security {suite}-security main",
)
# What the image needs beyond minbase: Python. chroot (coreutils) is in minbase already.
DEBIAN_PACKAGES = ("python3",)
# Documentation, manuals and translations are dead weight in an image.
DPKG_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*", "/usr/share/locale/*",
                 "/usr/share/lintian/*")  # fmt: skip
# The PATH of python:*-slim, which the Dockerfile's `ENV PATH=...:$PATH` extends.
BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV = {"PATH": BASE_PATH, "LANG": "C.UTF-8"}
# bookworm's glibc is 2.36: every manylinux tag up to it (pip takes --platform literally).
WHEEL_PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(36, 16, -1)), "manylinux2014_x86_64")


class DockerfileError(Exception):
    """The Dockerfile says something this builder does not reproduce: teach the builder, or change it back."""


@dataclass
class ImageSpec:
    """What the Dockerfile says the image is."""

    python: str = ""
    venv: str = ""
    user: str = ""
    uid: int = 0
    gid: int = 0
    shell: str = ""
    run_as: str = ""  # USER of the final stage; empty: root
    env: dict[str, str] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    cmd: list[str] = field(default_factory=list)
    installs_pyproject_dependencies: bool = False
    installs_project_without_deps: bool = False


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        if full:
            keyword, _, rest = full.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def _pairs(arguments: str) -> dict[str, str]:
    """KEY=VALUE pairs of ENV/LABEL (shell-quoted values)."""
    pairs = {}
    for token in shlex.split(arguments):
        key, eq, value = token.partition("=")
        if not eq:
            raise DockerfileError(f"only KEY=VALUE forms are understood, got {token!r}")
        pairs[key] = value
    return pairs


_USERADD = re.compile(
    r"^groupadd --gid (?P<gid>\d+) (?P<group>[a-z_][a-z0-9_-]*) && useradd --uid (?P<uid>\d+) --gid (?P=gid) "
    r"--no-create-home --shell (?P<shell>/\S+) (?P<user>[a-z_][a-z0-9_-]*)$"
)
_DEPS_FROM_PYPROJECT = "tomllib.load(open('pyproject.toml','rb'))['project']['dependencies']"


def parse_dockerfile(text: str) -> ImageSpec:
    """The image spec the Dockerfile's final stage describes; DockerfileError for anything not understood."""
    stages: list[list[tuple[str, str]]] = []
    for keyword, args in _instructions(text):
        if keyword == "FROM":
            stages.append([])
        if not stages:
            raise DockerfileError(f"{keyword} before the first FROM")
        stages[-1].append((keyword, args))
    if len(stages) != 2:
        raise DockerfileError(f"expected a build stage and a final stage, found {len(stages)} stage(s)")
    spec = ImageSpec()
    build, final = stages
    for keyword, args in build:
        if keyword == "RUN" and _DEPS_FROM_PYPROJECT in args.replace(" ", ""):
            spec.installs_pyproject_dependencies = True
        if keyword == "RUN" and re.search(r"pip install --no-deps \.$", args):
            spec.installs_project_without_deps = True
    env = dict(BASE_ENV)
    for keyword, args in final:
        if keyword == "FROM":
            match = re.fullmatch(r"python:(\d+\.\d+)-slim(?:-([a-z]+))?", args)
            if not match:
                raise DockerfileError(f"final stage FROM {args!r}: only python:X.Y-slim[-<debian>] is understood")
            spec.python = match.group(1)
            if match.group(2) and DEBIAN_FOR_PYTHON.get(spec.python) != match.group(2):
                raise DockerfileError(f"final stage FROM {args!r}: python {spec.python} is built on "
                                      f"{DEBIAN_FOR_PYTHON.get(spec.python)!r} here")  # fmt: skip
        elif keyword == "RUN":
            match = _USERADD.fullmatch(" ".join(args.split()))
            if not match or match.group("group") != match.group("user"):
                raise DockerfileError(
                    f"final stage RUN {args!r}: only the groupadd && useradd of one user is understood"
                )
            spec.user, spec.shell = match.group("user"), match.group("shell")
            spec.uid, spec.gid = int(match.group("uid")), int(match.group("gid"))
        elif keyword == "COPY":
            match = re.fullmatch(r"--from=build (/\S+) (/\S+)", args)
            if not match or match.group(1) != match.group(2):
                raise DockerfileError(f"final stage COPY {args!r}: only COPY --from=build <venv> <same path>")
            spec.venv = match.group(1)
        elif keyword == "ENV":
            for key, value in _pairs(args).items():
                env[key] = re.sub(r"\$(\w+)|\$\{(\w+)\}", lambda m: env.get(m.group(1) or m.group(2), ""), value)
        elif keyword == "LABEL":
            spec.labels.update(_pairs(args))
        elif keyword == "USER":
            if not re.fullmatch(r"\d+(:\d+)?", args):
                raise DockerfileError(f"USER {args!r}: only a numeric uid[:gid] is understood")
            spec.run_as = args
        elif keyword == "CMD":
            try:
                cmd = json.loads(args)
            except ValueError:
                cmd = None
            if not isinstance(cmd, list) or not all(isinstance(c, str) for c in cmd):
                raise DockerfileError(f"CMD {args!r}: only the JSON (exec) form is understood")
            spec.cmd = cmd
        else:
            raise DockerfileError(f"final stage {keyword} {args!r} is not understood by tests/testbed/image.py")
    spec.env = env
    missing = [
        what
        for what, ok in (
            ("FROM python:X.Y-slim", spec.python),
            ("the user (groupadd && useradd)", spec.user),
            ("COPY of the venv", spec.venv),
            ("CMD", spec.cmd),
            ("a build-stage RUN that installs pyproject.toml's dependencies", spec.installs_pyproject_dependencies),
            ("a build-stage RUN pip install --no-deps .", spec.installs_project_without_deps),
        )
        if not ok
    ]
    if missing:
        raise DockerfileError("the Dockerfile lacks " + ", ".join(missing))
    if spec.python not in DEBIAN_FOR_PYTHON:
        raise DockerfileError(f"python {spec.python}: no Debian release known with it ({sorted(DEBIAN_FOR_PYTHON)})")
    if not spec.env.get("PATH", "").startswith(f"{spec.venv}/bin:"):
        raise DockerfileError(f"ENV PATH must start with {spec.venv}/bin")
    return spec


def runtime_env(dockerfile: Path = DOCKERFILE) -> dict[str, str]:
    """The image's own ENV (not the base image's PATH and LANG): how our processes run in their containers,
    the allocator's and the model library's settings included, for benchmarks that run them as processes
    here."""
    spec = parse_dockerfile(dockerfile.read_text())
    return {k: v for k, v in spec.env.items() if k not in BASE_ENV}


def dependencies() -> list[str]:
    """The one list of what goes in: pyproject.toml's [project] dependencies."""
    with (REPO / "pyproject.toml").open("rb") as handle:
        deps: list[str] = tomllib.load(handle)["project"]["dependencies"]
    return deps


def entry_points() -> dict[str, str]:
    with (REPO / "pyproject.toml").open("rb") as handle:
        scripts: dict[str, str] = tomllib.load(handle)["project"]["scripts"]
    return scripts


def image_name() -> str:
    """The image the chart renders by default: values image.repository : Chart appVersion."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    return f"{values['image']['repository']}:{values['image'].get('tag') or chart['appVersion']}"


def log(message: str) -> None:
    print(f"[image {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _source_digest() -> str:
    """Every file of the packages that go into the image, by content (what git tracks and what it does not)."""
    sha = hashlib.sha256()
    for top in ("computedomain", "imex"):
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                sha.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for name in ("pyproject.toml", "README.md"):
        sha.update((REPO / name).read_bytes())
    return sha.hexdigest()[:16]


def _run(argv: list[str], **kwargs: object) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        raise RuntimeError(
            f"{' '.join(argv[:6])} ... failed ({result.returncode}):\n{output[:1500]}\n...\n{output[-1500:]}"
        )


def _cached_layer(key_dir: Path, build: Callable[[Path], Layer]) -> Layer:
    meta = key_dir / "layer.json"
    if meta.exists():
        (key_dir / ".used").touch()
        return Layer.from_json(json.loads(meta.read_text()))
    key_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    layer = build(key_dir)
    meta.write_text(json.dumps(layer.to_json()))
    (key_dir / ".used").touch()
    log(f"{key_dir.name}: {layer.size / 1e6:.1f} MB in {time.monotonic() - start:.0f}s")
    return layer


def testbin() -> Path:
    out = subprocess.run([str(REPO / "testbin" / "build.sh")], check=True, stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def base_rootfs(spec: ImageSpec) -> tuple[Path, Layer]:
    """Debian minbase with python3 and the image's user: the unpacked tree and its layer."""
    suite = DEBIAN_FOR_PYTHON[spec.python]
    key = _digest("base", 2, suite, DEBIAN_PACKAGES, DPKG_EXCLUDES, DEBIAN_MIRRORS, spec.user, spec.uid, spec.gid,
                  spec.shell)  # fmt: skip
    key_dir = CACHE / f"base-{suite}-{key}"

    def build(out: Path) -> Layer:
        rootfs = out / "rootfs"
        shutil.rmtree(rootfs, ignore_errors=True)
        mmdebstrap = (testbin() / "mmdebstrap").resolve()  # its helpers (mmtarfilter, ...) lie beside it
        argv = [
            "unshare", "--mount", "--propagation", "private", "--",
            "perl", str(mmdebstrap), "--mode=root", "--variant=minbase", "--format=directory", "--quiet",
            f"--include={','.join(DEBIAN_PACKAGES)}",
            "--aptopt=Acquire::Languages \"none\"",
            # Merged /usr through the symlinks debootstrap makes, not the usrmerge package (it drags in Perl).
            f"--hook-dir={mmdebstrap.parents[1] / 'share' / 'mmdebstrap' / 'hooks' / 'merged-usr'}",
            *(f"--dpkgopt=path-exclude={p}" for p in DPKG_EXCLUDES),
            "--dpkgopt=path-include=/usr/share/doc/*/copyright",
            "--customize-hook=rm -rf \"$1\"/var/lib/apt/lists/* \"$1\"/var/cache/apt/* \"$1\"/var/log/*",
            suite, str(rootfs), *(m.format(suite=suite) for m in DEBIAN_MIRRORS),
        ]  # fmt: skip
        log(f"laying out Debian {suite} minbase + {' '.join(DEBIAN_PACKAGES)} (mmdebstrap)")
        _run(argv, env={**os.environ, "PATH": f"{mmdebstrap.parent}:{os.environ.get('PATH', '')}:/usr/sbin:/sbin"})
        version = subprocess.run(["chroot", str(rootfs), "python3", "-c", "import sys; print(sys.version[:4])"],
                                 check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
        if not version.startswith(spec.python):
            raise DockerfileError(f"Debian {suite} has python {version}, the Dockerfile names {spec.python}")
        with (rootfs / "etc" / "group").open("a") as group:
            group.write(f"{spec.user}:x:{spec.gid}:\n")
        with (rootfs / "etc" / "passwd").open("a") as passwd:
            passwd.write(f"{spec.user}:x:{spec.uid}:{spec.gid}::/nonexistent:{spec.shell}\n")
        return write_layer(rootfs, out / "layer.tar.gz")

    return key_dir / "rootfs", _cached_layer(key_dir, build)


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q", *args]


def deps_layer(spec: ImageSpec) -> Layer:
    """The venv: its skeleton (python -> Debian's python3) and the dependencies as wheels from PyPI."""
    deps = dependencies()
    key = _digest("deps", 2, spec.python, spec.venv, deps, WHEEL_PLATFORMS)
    py = f"python{spec.python}"

    def build(out: Path) -> Layer:
        shutil.rmtree(out / "tree", ignore_errors=True)
        tree = out / "tree" / spec.venv.strip("/")
        site = tree / "lib" / py / "site-packages"
        log(f"{len(deps)} dependencies as wheels from PyPI")
        _run(_pip("install", "--only-binary=:all:", "--no-compile", "--target", str(site),
                  "--python-version", spec.python, "--implementation", "cp", "--abi", f"cp{spec.python.replace('.', '')}",
                  *(f"--platform={p}" for p in WHEEL_PLATFORMS), *deps))  # fmt: skip
        shutil.rmtree(site / "bin", ignore_errors=True)  # console scripts with this machine's interpreter
        _compile(site, spec)
        (tree / "bin").mkdir()
        for link, target in (("python", py), ("python3", py), (py, f"/usr/bin/{py}")):
            (tree / "bin" / link).symlink_to(target)
        (tree / "pyvenv.cfg").write_text(
            f"home = /usr/bin\ninclude-system-site-packages = false\nversion = {spec.python}\n"
            f"executable = /usr/bin/{py}\ncommand = /usr/bin/{py} -m venv {spec.venv}\n"
        )
        return write_layer(out / "tree", out / "layer.tar.gz")

    return _cached_layer(CACHE / f"deps-{key}", build)


def _compile(site: Path, spec: ImageSpec) -> None:
    """Byte-compile as `pip install` in the Dockerfile does, so containers do not compile at each start
    (PYTHONDONTWRITEBYTECODE=1 keeps them from caching it). Any 3.X interpreter writes 3.X bytecode."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != spec.python:
        return  # another Python here: leave the sources alone rather than write the wrong bytecode
    _run([sys.executable, "-m", "compileall", "-q", "-j", "2", str(site)])


def project_layer(spec: ImageSpec) -> Layer:
    """computedomain and imex, built from this checkout, and their entry points in the venv's bin."""
    key = _digest("project", 2, spec.python, spec.venv, _source_digest(), entry_points())
    py = f"python{spec.python}"

    def build(out: Path) -> Layer:
        shutil.rmtree(out / "tree", ignore_errors=True)
        tree = out / "tree" / spec.venv.strip("/")
        site = tree / "lib" / py / "site-packages"
        with _scratch_copy() as src:
            _run(_pip("install", "--no-deps", "--no-compile", "--target", str(site), str(src)))
        shutil.rmtree(site / "bin", ignore_errors=True)
        _compile(site, spec)
        (tree / "bin").mkdir()
        for name, target in entry_points().items():
            module, _, func = target.partition(":")
            script = tree / "bin" / name
            script.write_text(
                f"#!{spec.venv}/bin/python\nimport sys\nfrom {module} import {func}\n\nif __name__ == '__main__':\n"
                f"    sys.exit({func}())\n"
            )
            script.chmod(0o755)
        return write_layer(out / "tree", out / "layer.tar.gz")

    return _cached_layer(CACHE / f"project-{key}", build)


class _scratch_copy:  # noqa: N801 - used as a context manager like tempfile's
    """A copy of what `pip install .` needs, so the build writes no egg-info or build/ into the checkout."""

    def __enter__(self) -> Path:
        CACHE.mkdir(parents=True, exist_ok=True)
        self.dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"cd-image-src-{os.getpid()}"
        shutil.rmtree(self.dir, ignore_errors=True)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for top in ("computedomain", "imex"):
            shutil.copytree(REPO / top, self.dir / top, ignore=ignore)
        for name in ("pyproject.toml", "README.md"):
            shutil.copy2(REPO / name, self.dir / name)
        return self.dir

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


@dataclass(frozen=True)
class Built:
    archive: Path
    name: str
    size: int  # compressed: layers + config + manifest
    lowers: list[Path]  # the unpacked layers, topmost first (an overlay's lowerdir= order)
    seconds: float
    rebuilt: bool


def build(dockerfile: Path = DOCKERFILE) -> Built:
    start = time.monotonic()
    spec = parse_dockerfile(dockerfile.read_text())
    rootfs, base = base_rootfs(spec)
    layers = [base, deps_layer(spec), project_layer(spec)]
    lowers = [la.path.parent / "tree" for la in reversed(layers[1:])] + [rootfs]
    name = image_name()
    config = ImageConfig(
        env=[f"{k}={v}" for k, v in spec.env.items()],
        cmd=spec.cmd,
        user=spec.run_as,
        labels=spec.labels,
        working_dir="/",
    )
    key = _digest("image", 2, name, [la.digest for la in layers], config.env, config.cmd, config.user, config.labels)
    out = CACHE / f"image-{key}"
    archive = out / "computedomain.oci.tar"
    rebuilt = not archive.exists()
    if rebuilt:
        size = write_archive(archive, name, layers, config)
        (out / "size").write_text(str(size))
    (out / ".used").touch()
    _prune()
    return Built(archive, name, int((out / "size").read_text()), lowers, time.monotonic() - start, rebuilt)


def _prune() -> None:
    """Drop cache entries no checkout has used for PRUNE_DAYS days (each use touches `.used`)."""
    cutoff = time.time() - PRUNE_DAYS * 86400
    for entry in CACHE.iterdir():
        stamp = entry / ".used"
        try:
            used = stamp.stat().st_mtime
        except OSError:
            used = entry.stat().st_mtime + 86400  # being built by someone right now, or given up a day ago
        if used < cutoff:
            log(f"removing {entry.name} (unused for {PRUNE_DAYS} days)")
            shutil.rmtree(entry, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.testbed.image", description=__doc__.split("\n")[0])
    parser.add_argument("--print", action="store_true", help="print only the archive's path")
    args = parser.parse_args(argv)
    try:
        built = build()
    except DockerfileError as exc:
        print(f"Dockerfile: {exc}", file=sys.stderr)
        return 2
    if args.print:
        print(built.archive)
        return 0
    what = "built" if built.rebuilt else "up to date"
    print(f"{built.name}: {built.archive}\n  {built.size / 1e6:.1f} MB compressed, {what} in {built.seconds:.1f}s\n"
          f"  import: ctr -n k8s.io images import {built.archive}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
