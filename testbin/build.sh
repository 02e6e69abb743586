#!/usr/bin/env bash
# Builds the test bed's binaries and caches them: the control plane, kwok and helm from the Go module proxy,
# and for the real nodes the kubelet, containerd (+ ctr and the runc shim), the pause program, and runc,
# the CNI plugins and mmdebstrap unpacked from Debian packages (nothing is installed system-wide).
#
#   testbin/build.sh                  build whatever is missing, print the bin directory last
#   testbin/build.sh control-plane    only what the control plane and the simulated cluster run (etcd,
#                                     kube-apiserver, -controller-manager, -scheduler, kubectl, kwok, helm)
#   testbin/build.sh --print          print the bin directory without building
#
# Missing sets build two at a time (the largest first) while every set's modules download at once; the
# script prints one line per step and a progress line every 30 s, and writes the Go toolchain's output
# to ${XDG_CACHE_HOME:-~/.cache}/computedomain/logs/<set>.log (shown when a build fails). The toolchain's
# own caches (GOMODCACHE, GOCACHE) default to ${XDG_CACHE_HOME:-~/.cache}/computedomain/go/.
#
# Each Go tool has its own module here (go.mod + go.sum; the pause program also its main.go). Every set of
# binaries lands in its own directory under
#   ${XDG_CACHE_HOME:-~/.cache}/computedomain/testbin/<set>-<version>-<go version>-<digest>/
# where the digest covers that set's module files and build flags, so a version bump rebuilds exactly the
# set that changed. The printed bin directory holds links to every binary of the current sets.
#
# Several checkouts share the cache, each possibly at another version: a set is removed only when no
# checkout has used it for PRUNE_DAYS days (every use touches its `.used` stamp).
set -euo pipefail
shopt -s nullglob

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# -mod=readonly: build exactly what go.sum pins; never resolve anything new at build time.
export GOTOOLCHAIN=local GOFLAGS=-mod=readonly CGO_ENABLED=0
PRUNE_DAYS=5

K8S_VERSION=v1.36.3
# The version a module requires, read from its go.mod (the require lines sit inside a block).
required() { awk -v m="$2" '$1==m {print $2; exit}' "$here/$1/go.mod"; }
ETCD_VERSION=$(required etcd go.etcd.io/etcd/server/v3)
# helm and kwok build in the Kubernetes module, against its k8s.io modules: one build compiles them once.
KWOK_VERSION=$(required k8s sigs.k8s.io/kwok)
HELM_VERSION=$(required k8s helm.sh/helm/v3)
CONTAINERD_VERSION=$(required containerd github.com/containerd/containerd/v2)
# From Debian (bookworm): what needs cgo (runc), is plain files (CNI plugins), or is a Perl program
# (mmdebstrap, which tests/testbed/image.py runs to lay out the image's root filesystem).
DEBIAN_PACKAGES=(runc containernetworking-plugins mmdebstrap)

go_version=$(go env GOVERSION)
cache_root=${XDG_CACHE_HOME:-$HOME/.cache}/computedomain/testbin

k8s_minor=${K8S_VERSION#v1.}; k8s_minor=${k8s_minor%%.*}
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
helm_ldflags="-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$k8s_minor"
helm_ldflags+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$k8s_minor"
# One link line for the whole set: the linker ignores an -X whose variable a binary lacks.
k8s_ldflags+=" $helm_ldflags -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}"
etcd_ldflags="-s -w"
containerd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
containerd_ldflags+=" -X github.com/containerd/containerd/v2/version.Revision=testbed"
# No snapshotters that need cgo or host tools; the nodes use overlayfs.
containerd_tags="no_btrfs no_devmapper no_zfs"

# name -> "module_dir|version|ldflags|tags|packages..." ; the digest of a set covers all of it.
declare -A recipe=(
  [etcd]="etcd|$ETCD_VERSION|$etcd_ldflags||go.etcd.io/etcd/server/v3"
  [k8s]="k8s|$K8S_VERSION|$k8s_ldflags||k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl k8s.io/kubernetes/cmd/kubelet helm.sh/helm/v3/cmd/helm sigs.k8s.io/kwok/cmd/kwok"
  [containerd]="containerd|$CONTAINERD_VERSION|$containerd_ldflags|$containerd_tags|github.com/containerd/containerd/v2/cmd/containerd github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 github.com/containerd/containerd/v2/cmd/ctr"
  [pause]="pause|v1|-s -w||."
)
# The binaries each set provides (and links into the bin directory).
declare -A provides=(
  [etcd]="etcd"
  [k8s]="kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet helm kwok"
  [containerd]="containerd containerd-shim-runc-v2 ctr" [pause]="pause"
  [debian]="runc cni mmdebstrap"
)
sets=(etcd k8s containerd pause debian)

declare -A dir
for name in "${!recipe[@]}"; do
  IFS='|' read -r module version _ <<<"${recipe[$name]}"
  digest=$( (cat "$here/$module"/go.*[dm] "$here/$module"/*.go; echo "${recipe[$name]}") | sha256sum | cut -c1-12)
  dir[$name]="$cache_root/$name-$version-$go_version-$digest"
done
dir[debian]="$cache_root/debian-bookworm-$(echo "${DEBIAN_PACKAGES[*]}" | sha256sum | cut -c1-12)"
bin="$cache_root/bin-$(for s in "${sets[@]}"; do echo "${dir[$s]}"; done | sha256sum | cut -c1-12)"

# What a target needs. `control-plane`: what `make cluster-up` and the simulated demo run; `all` adds the
# real nodes' kubelet, containerd, runc, the pause program, the CNI plugins and mmdebstrap (for the image).
control_plane=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)
case "${1:-all}" in
  --print) echo "$bin"; exit 0 ;;
  control-plane) wanted=" ${control_plane[*]} " ;;
  all) wanted=" ${provides[*]} " ;;
  *) echo "usage: testbin/build.sh [control-plane|all|--print] (got '$1')" >&2; exit 2 ;;
esac

log() { printf '[testbin %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
elapsed() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# The binaries of set $1 that the target wants and the cache lacks.
missing() {
  local f out=()
  for f in ${provides[$1]}; do
    if [[ "$wanted" == *" $f "* && ! -e "${dir[$1]}/$f" ]]; then out+=("$f"); fi
  done
  echo "${out[*]}"
}

# The Go package that builds binary $2 of set $1 (a set of one package builds one binary).
package_of() {
  local module version ldflags tags packages p
  IFS='|' read -r module version ldflags tags packages <<<"${recipe[$1]}"
  # shellcheck disable=SC2086 # packages is a list
  set -- $packages "$2"
  if (($# == 2)); then echo "$1"; return; fi
  local want=${!#}
  for p in "${@:1:$#-1}"; do
    if [[ "${p##*/}" == "$want" ]]; then echo "$p"; return; fi
  done
  return 1
}

# The Go toolchain's module and build caches live beside the binaries (one place to look at or delete;
# -modcacherw keeps the module cache deletable with rm), unless the environment names others.
go_root=${XDG_CACHE_HOME:-$HOME/.cache}/computedomain/go
export GOMODCACHE=${GOMODCACHE:-$go_root/mod} GOCACHE=${GOCACHE:-$go_root/build}
export GOFLAGS="$GOFLAGS -modcacherw"
logs=${XDG_CACHE_HOME:-$HOME/.cache}/computedomain/logs
status=$(mktemp -d)
ticker=
cleanup() {
  [[ -n $ticker ]] && kill "$ticker" 2>/dev/null
  rm -rf "$status"
}
trap cleanup EXIT

# Builds the missing binaries of a set into a scratch directory and renames, so an interrupted build never
# leaves a half binary. The toolchain's output (module downloads, errors) goes to the set's log.
build_go() {
  local name=$1 d=${dir[$1]} module version ldflags tags packages tmp start f b pkgs=() logfile
  IFS='|' read -r module version ldflags tags packages <<<"${recipe[$name]}"
  for b in $(missing "$name"); do pkgs+=("$(package_of "$name" "$b")"); done
  mkdir -p "$d"
  tmp=$(mktemp -d "$d/.build-XXXXXX")
  logfile="$logs/$name.log"
  start=$SECONDS
  missing "$name" >"$status/$name.running"
  log "building $name $version: $(cat "$status/$name.running") (log $logfile)"
  if ! (cd "$here/$module" && go build -p 2 -trimpath -pgo=off -tags "$tags" -ldflags "$ldflags" -o "$tmp/" "${pkgs[@]}") \
    >"$logfile" 2>&1; then
    rm -rf "$tmp"
    log "building $name failed; the last lines of $logfile:"
    tail -n 40 "$logfile" >&2
    return 1
  fi
  # go names the etcd server binary after its module ("server") and the pause program after its module.
  [[ -e "$tmp/server" ]] && mv "$tmp/server" "$tmp/etcd"
  [[ "$name" == pause ]] && mv "$tmp"/* "$tmp/pause.tmp" && mv "$tmp/pause.tmp" "$tmp/pause"
  for f in "$tmp"/*; do mv -f "$f" "$d/"; done
  rmdir "$tmp"
  mv "$status/$name.running" "$status/$name.done"
  log "built $name ($(cat "$status/$name.done")) in $(elapsed $((SECONDS - start)))"
}

# Debian packages unpacked (dpkg -x) into the cache; the machine's package database is not touched.
fetch_debian() {
  local d=${dir[debian]} tmp start deb logfile="$logs/debian.log"
  mkdir -p "$d"
  tmp=$(mktemp -d "$d/.fetch-XXXXXX")
  start=$SECONDS
  echo "${DEBIAN_PACKAGES[*]}" >"$status/debian.running"
  if ! (cd "$tmp" && apt-get download -q "${DEBIAN_PACKAGES[@]}" >"$logfile" 2>&1); then
    # A machine whose package lists are missing or stale: refresh them, then try once more.
    if ! { apt-get update -qq && (cd "$tmp" && apt-get download -q "${DEBIAN_PACKAGES[@]}"); } >>"$logfile" 2>&1; then
      log "fetching ${DEBIAN_PACKAGES[*]} failed; the last lines of $logfile:"
      tail -n 20 "$logfile" >&2
      return 1
    fi
  fi
  mkdir -p "$tmp/root"
  for deb in "$tmp"/*.deb; do dpkg -x "$deb" "$tmp/root"; done
  (cd "$tmp" && ls -1 ./*.deb) >"$tmp/root/PACKAGES"
  rm -f "$tmp"/*.deb
  ln -sfn root/usr/sbin/runc "$tmp/runc"
  ln -sfn root/usr/lib/cni "$tmp/cni"
  ln -sfn root/usr/bin/mmdebstrap "$tmp/mmdebstrap"
  rm -rf "$d/root"
  for f in root runc cni mmdebstrap; do mv -f -T "$tmp/$f" "$d/$f"; done
  rm -rf "$tmp"
  mv "$status/debian.running" "$status/debian.done"
  log "unpacked ${DEBIAN_PACKAGES[*]} from Debian in $(elapsed $((SECONDS - start)))"
}

count_alive() {
  local pid n=0
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done
  echo "$n"
}

# One line every 30 s while anything builds: what, how far, for how long, where.
progress() {
  local f names
  while true; do
    # The sleep holds none of the caller's pipes: killing this loop leaves nobody waiting for it.
    sleep 30 </dev/null >/dev/null 2>&1 &
    wait $! || true
    names=()
    for f in "$status"/*.running; do names+=("$(basename "$f" .running) ($(cat "$f" 2>/dev/null || true))"); done
    set -- "$status"/*.done
    log "$(elapsed $((SECONDS - begin))): $# of ${#todo[@]} sets built; building ${names[*]:-...};" \
      "cache $cache_root, toolchain output in $logs"
  done
}

todo=()
for name in "${sets[@]}"; do
  if [[ -n $(missing "$name") ]]; then todo+=("$name"); fi
done
if ((${#todo[@]})); then
  begin=$SECONDS
  mkdir -p "$logs"
  log "building ${todo[*]} into $cache_root (a first build takes minutes; progress every 30s)"
  # The modules of every set at once (network-bound), while the builds start (CPU-bound): go waits for a
  # module another process is downloading.
  downloads=()
  for name in "${todo[@]}"; do
    if [[ $name == debian ]]; then continue; fi
    IFS='|' read -r module _ <<<"${recipe[$name]}"
    (cd "$here/$module" && go mod download >>"$logs/download.log" 2>&1 || true) &
    downloads+=($!)
  done
  progress &
  ticker=$!
  # Two builds at a time on two cores: one links or downloads while the other compiles. The largest first.
  lanes=()
  for name in k8s etcd containerd pause debian; do
    if [[ " ${todo[*]} " == *" $name "* ]]; then lanes+=("$name"); fi
  done
  running=()
  for name in "${lanes[@]}"; do
    while (($(count_alive "${running[@]}") >= 2)); do sleep 1; done
    if [[ $name == debian ]]; then fetch_debian & else build_go "$name" & fi
    running+=($!)
  done
  for pid in "${running[@]}" "${downloads[@]}"; do wait "$pid" || true; done
  for name in "${todo[@]}"; do
    [[ -z $(missing "$name") ]] || { log "$name was not built (see above)"; exit 1; }
  done
  log "built ${todo[*]} in $(elapsed $((SECONDS - begin)))"
fi
for name in "${sets[@]}"; do
  if [[ -d ${dir[$name]} ]]; then touch "${dir[$name]}/.used"; fi
done

mkdir -p "$bin"
for name in "${sets[@]}"; do
  for f in ${provides[$name]}; do ln -sfn "${dir[$name]}/$f" "$bin/$f"; done
done
touch "$bin/.used"

# Remove sets no checkout has used for PRUNE_DAYS days (about 0.5 GB per control-plane set).
for old in "$cache_root"/*/; do
  old=${old%/}
  if [[ ! -e "$old/.used" ]] || [[ -n $(find "$old/.used" -mtime +"$PRUNE_DAYS" 2>/dev/null) ]]; then
    # A set without a stamp may be one another checkout is building right now: only stale ones go.
    [[ -e "$old/.used" ]] || [[ -n $(find "$old" -maxdepth 0 -mmin +600 2>/dev/null) ]] || continue
    log "removing $(basename "$old") (unused for $PRUNE_DAYS days)"
    rm -rf "$old"
  fi
done

log "all binaries present in $bin"
echo "$bin"
