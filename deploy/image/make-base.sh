#!/usr/bin/env bash
# deploy/image/make-base.sh [--rebuild]: the Debian 12 base image of the
# project's dmuond images, made here from Debian's packages alone (no
# container registry is needed): debootstrap's minbase of bookworm from the
# mirror apt already uses (or $DMUON_DEBIAN_MIRROR), trimmed of what a
# container never reads (apt's package lists and caches, manuals,
# translations, documentation but the copyright files), imported with
# `podman import`.
#
# Cached by a hash of this recipe (its suite, variant and package list are
# the variables below): the image is localhost/dmuon-base:bookworm-<hash>,
# and a call finds it and returns at once; a changed recipe makes a new one.
# --rebuild makes it again (say, for Debian's security updates). The
# versions installed are listed in <containers cache>/base-<hash>.packages.
# Needs root (debootstrap). Two calls at once (two checkouts) make it once:
# the second waits on a lock in the containers cache and finds it made.
# Last line printed: the image reference.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=deploy/image/lib.sh
source "$HERE/lib.sh"

SUITE=bookworm
VARIANT=minbase
# Packages added to minbase (none: the images bundle every library their
# binaries load beyond glibc, libstdc++ and libgcc, which minbase has).
INCLUDE=()

key=$(sha256sum "$HERE/make-base.sh" | cut -c1-12)
ref=localhost/dmuon-base:$SUITE-$key
log() { printf 'make-base: %s\n' "$*" >&2; }
rebuild=0
while (($#)); do
  case $1 in
    --rebuild) rebuild=1 ;;
    *) log "error: unknown argument '$1' (usage: make-base.sh [--rebuild])"; exit 2 ;;
  esac
  shift
done

podman_ info >/dev/null || { log "error: podman does not work (above)"; exit 1; }
if ((!rebuild)) && podman_ image exists "$ref"; then
  echo "$ref"
  exit 0
fi
# One maker at a time; one that waited finds the image made.
mkdir -p "$(containers_cache)"
exec 9>"$(containers_cache)/base.lock"
flock 9
if ((!rebuild)) && podman_ image exists "$ref"; then
  echo "$ref"
  exit 0
fi
[[ $(id -u) == 0 ]] || { log "error: debootstrap needs root"; exit 1; }
command -v debootstrap >/dev/null || { log "error: debootstrap is not installed: run ./dmuon setup"; exit 1; }

# The first Debian archive apt is configured with for $SUITE (deb822
# .sources or one-line .list), e.g. http://deb.debian.org/debian.
apt_mirror() {
  local f
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [[ -f $f ]] || continue
    awk -v s="$SUITE" '$1 == "deb" && $0 !~ /security/ {
        for (i = 2; i <= NF; i++) if ($i !~ /^\[/ && $(i + 1) == s) { print $i; exit } }' "$f"
  done
  for f in /etc/apt/sources.list.d/*.sources; do
    [[ -f $f ]] || continue
    awk -v s="$SUITE" 'BEGIN { RS = ""; FS = "\n" } {
        uri = ""; ok = 0
        for (i = 1; i <= NF; i++) {
          if ($i ~ /^URIs:/) { split($i, u, /[ \t]+/); uri = u[2] }
          if ($i ~ /^Suites:/ && (" " $i " ") ~ (" " s " ")) ok = 1
        }
        if (ok && uri != "" && uri !~ /security/) { print uri; exit } }' "$f"
  done
}
mirror=${DMUON_DEBIAN_MIRROR:-$(apt_mirror | head -n 1)}
[[ -n $mirror ]] || { log "error: no Debian $SUITE mirror in /etc/apt/sources.list*; set DMUON_DEBIAN_MIRROR"; exit 1; }

work=$(mktemp -d "${TMPDIR:-/tmp}/dmuon-base.XXXXXX")
root=$work/rootfs
# debootstrap mounts /proc and /sys inside the tree while it runs: never
# remove the tree with a file system still mounted in it.
cleanup() {
  local m
  for m in $(findmnt -rn -o TARGET | grep -F "$root/" | sort -r); do umount -l "$m" || true; done
  if findmnt -rn -o TARGET | grep -qF "$root/"; then
    log "warning: $root still has mounts; left in place"
  else
    rm -rf "$work"
  fi
}
trap cleanup EXIT

t=$SECONDS
log "debootstrap --variant=$VARIANT $SUITE from $mirror (about a minute)"
include=()
((${#INCLUDE[@]})) && include=("--include=$(IFS=,; echo "${INCLUDE[*]}")")
if ! debootstrap --variant="$VARIANT" "${include[@]}" "$SUITE" "$root" "$mirror" >"$work/debootstrap.log" 2>&1; then
  tail -n 20 "$work/debootstrap.log" >&2
  log "error: debootstrap failed (log above)"
  exit 1
fi
# shellcheck disable=SC2016 # dpkg-query's own ${...} fields
chroot "$root" dpkg-query -W -f '${Package} ${Version}\n' >"$work/packages"
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/cache/debconf/*-old \
  "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* \
  "$root"/var/log/* "$root"/tmp/* "$root"/root/.bash_history
find "$root/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
find "$root/usr/share/doc" -mindepth 1 -type d -empty -delete
# Every image of the same recipe gets the same machine identity: none.
: >"$root/etc/machine-id"
tar --one-file-system --numeric-owner -C "$root" -c . |
  podman_ import --quiet --message "debootstrap --variant=$VARIANT $SUITE ($mirror)" \
    --change 'CMD ["/bin/bash"]' - "$ref" >/dev/null
mkdir -p "$(containers_cache)"
cp "$work/packages" "$(containers_cache)/base-$key.packages"
log "made $ref in $((SECONDS - t)) s ($(wc -l <"$work/packages") packages)"
echo "$ref"
