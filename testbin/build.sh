#!/usr/bin/env bash
# Builds the test bed's control plane from the Go module proxy and caches the binaries.
#
#   testbin/build.sh            build whatever is missing, print the bin directory last
#   testbin/build.sh --print    print the bin directory without building
#
# Each tool has its own Go module here (go.mod + go.sum only). Binaries land in
#   ${XDG_CACHE_HOME:-~/.cache}/computedomain-testbin/<key>/
# where <key> covers the tool versions, the Go version and a hash of the module files and this script,
# so a warm run is a few stat calls and a version bump rebuilds exactly what changed.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# -mod=readonly: build exactly what go.sum pins; never resolve anything new at build time.
export GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=0

K8S_VERSION=v1.36.3
# The version a module requires, read from its go.mod (the require lines sit inside a block).
required() { awk -v m="$2" '$1==m {print $2; exit}' "$here/$1/go.mod"; }
ETCD_VERSION=$(required etcd go.etcd.io/etcd/server/v3)
KWOK_VERSION=$(required kwok sigs.k8s.io/kwok)
HELM_VERSION=$(required helm helm.sh/helm/v3)

go_version=$(go env GOVERSION)
digest=$(cat "$here"/*/go.mod "$here"/*/go.sum "$here/build.sh" | sha256sum | cut -c1-12)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/computedomain-testbin
bin="$cache_root/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-kwok-$KWOK_VERSION-helm-$HELM_VERSION-$go_version-$digest"

if [[ "${1:-}" == "--print" ]]; then
  echo "$bin"
  exit 0
fi

mkdir -p "$bin"
log() { printf '[testbin %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

have() {
  local f
  for f in "$@"; do [[ -x "$bin/$f" ]] || return 1; done
}

# Builds into a scratch directory and renames, so an interrupted build never leaves a half binary.
build() {
  local name=$1 module_dir=$2 ldflags=$3
  shift 3
  local tmp
  tmp=$(mktemp -d "$bin/.build-XXXXXX")
  log "building $name (cold builds take a while on 2 cores; warm ones reuse the Go build cache)"
  local start=$SECONDS
  (cd "$here/$module_dir" && go build -trimpath -pgo=off -ldflags "$ldflags" -o "$tmp/" "$@")
  local f
  for f in "$tmp"/*; do mv -f "$f" "$bin/"; done
  rmdir "$tmp"
  log "built $name in $((SECONDS - start))s"
}

k8s_minor=${K8S_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
helm_minor=$k8s_minor
helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$helm_minor"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$helm_minor"
kwok_ldflags="-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
etcd_ldflags="-s -w"

# go names the etcd server binary after its module ("server"); the test bed calls it etcd.
have etcd || { build "etcd $ETCD_VERSION" etcd "$etcd_ldflags" go.etcd.io/etcd/server/v3 && mv -f "$bin/server" "$bin/etcd"; }
have kwok || build "kwok $KWOK_VERSION" kwok "$kwok_ldflags" sigs.k8s.io/kwok/cmd/kwok
have helm || build "helm $HELM_VERSION" helm "$helm_ldflags" helm.sh/helm/v3/cmd/helm
have kube-apiserver kube-controller-manager kube-scheduler kubectl ||
  build "kube-apiserver, kube-controller-manager, kube-scheduler, kubectl $K8S_VERSION" k8s "$k8s_ldflags" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl

# Binaries of other versions are dead weight (about 0.5 GB each): keep only the current set.
for old in "$cache_root"/*/; do
  [[ "${old%/}" == "$bin" ]] || { log "removing outdated $(basename "$old")"; rm -rf "$old"; }
done

log "all binaries present in $bin"
echo "$bin"
