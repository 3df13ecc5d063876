#!/usr/bin/env bash
# Builds labsync's packages from one staged tree, into target/package/:
#
#   labsync_<version>-1_<arch>.deb          (dpkg-deb; Debian, Ubuntu)
#   labsync-<version>-1.<arch>.rpm           (cargo-generate-rpm; RHEL, Fedora, SUSE)
#   labsync-<version>-<arch>-linux-gnu.tar.gz  (anything with glibc)
#
# Each holds /usr/bin/{labsync,labrun,labd}, the systemd unit
# /lib/systemd/system/labd.service and a commented /etc/labsync/labd.toml
# (a conffile: an upgrade keeps the admin's; in the tarball it is
# labd.toml.example, so `tar -C /` never overwrites one). The oldest glibc the
# binaries need is read off them and written into each package's dependencies
# and into target/package/GLIBC_MIN.
#
#   scripts/package.sh                 release build, then all three packages
#   scripts/package.sh --deb-only      the .deb and the tarball (no cargo-generate-rpm)
#   LABSYNC_BIN=DIR scripts/package.sh use binaries already built in DIR (the tests do)
#
# cargo-generate-rpm is installed with cargo when missing (~3 min, once).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rpm=1
for a in "$@"; do
  case "$a" in
    --deb-only) rpm=0 ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "package.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
  esac
done

version="$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)"
[ -n "$version" ] || { echo "package.sh: no version in Cargo.toml" >&2; exit 1; }
arch_deb="$(dpkg --print-architecture 2>/dev/null || echo amd64)"
arch="$(uname -m)"

if [ -z "${LABSYNC_BIN:-}" ]; then
  cargo build --release --locked -p labsync-cli
  LABSYNC_BIN="$root/target/release"
fi
for b in labsync labrun labd; do
  [ -x "$LABSYNC_BIN/$b" ] || { echo "package.sh: $LABSYNC_BIN/$b is not built" >&2; exit 1; }
done

out="${LABSYNC_PACKAGE_OUT:-$root/target/package}"
stage="$out/stage"
rm -rf "$stage"
mkdir -p "$stage/usr/bin" "$stage/lib/systemd/system" "$stage/etc/labsync" \
  "$stage/usr/share/doc/labsync"
for b in labsync labrun labd; do
  install -m 755 "$LABSYNC_BIN/$b" "$stage/usr/bin/$b"
  # Debug info is for developers; a package ships the code only.
  strip --strip-debug "$stage/usr/bin/$b"
done
# The unit as the package installs it: labd in /usr/bin.
sed 's#/usr/local/bin/labd#/usr/bin/labd#' dist/systemd/labd.service \
  > "$stage/lib/systemd/system/labd.service"
chmod 644 "$stage/lib/systemd/system/labd.service"
install -m 644 dist/labd.toml "$stage/etc/labsync/labd.toml"
install -m 644 README.md "$stage/usr/share/doc/labsync/README.md"
cp -r docs "$stage/usr/share/doc/labsync/docs"
chmod -R a+rX,go-w "$stage/usr/share/doc/labsync"
# Every folder 755 whatever the builder's umask: GNU tar run as root gives
# existing folders (/usr, /etc) the archive's modes.
find "$stage" -type d -exec chmod 755 {} +
printf 'labsync %s\nLicense: Apache-2.0\n' "$version" > "$stage/usr/share/doc/labsync/copyright"

# The oldest glibc the binaries need: the highest GLIBC_ symbol version
# any of them links against.
glibc_min="$(for b in labsync labrun labd; do
  objdump -T "$stage/usr/bin/$b" 2>/dev/null | grep -o 'GLIBC_[0-9][0-9.]*' || true
done | sed 's/GLIBC_//' | sort -Vu | tail -1)"
[ -n "$glibc_min" ] || { echo "package.sh: cannot read the binaries' glibc versions (objdump)" >&2; exit 1; }
echo "$glibc_min" > "$out/GLIBC_MIN"

# --- .deb ---------------------------------------------------------------
deb_root="$out/deb-root"
rm -rf "$deb_root"
cp -a "$stage" "$deb_root"
mkdir -p "$deb_root/DEBIAN"
installed_kb="$(du -sk "$stage" | cut -f1)"
cat > "$deb_root/DEBIAN/control" <<EOF
Package: labsync
Version: $version-1
Architecture: $arch_deb
Maintainer: labsync developers <labsync@example.invalid>
Depends: libc6 (>= $glibc_min), libgcc-s1
Section: admin
Priority: optional
Installed-Size: $installed_kb
Homepage: https://example.invalid/labsync
Description: GPU leases, job placement and dataset sync for a lab's GPU servers
 labsync replaces a lab's GPU spreadsheet: labrun runs a job on GPUs nobody
 else holds, on the node that already caches its data; labsync pushes and
 pulls datasets and code through a content-addressed store; labd runs on
 every GPU server. Configure /etc/labsync/labd.toml (labd init makes a
 cluster's), then: systemctl enable --now labd.
EOF
echo /etc/labsync/labd.toml > "$deb_root/DEBIAN/conffiles"
cat > "$deb_root/DEBIAN/postinst" <<'EOF'
#!/bin/sh
# labsync's postinst: the state and cache folders; on an upgrade, a running
# labd restarted on the new binary (it adopts its running jobs: the unit's
# KillMode=process leaves them alone). A first install starts nothing.
# DPKG_ROOT: the root being installed into (dpkg --root, chrootless).
set -e
if [ "$1" = configure ]; then
  mkdir -p "$DPKG_ROOT/var/lib/labsync" "$DPKG_ROOT/var/cache/labsync"
  chmod 755 "$DPKG_ROOT/var/lib/labsync" "$DPKG_ROOT/var/cache/labsync"
  if [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || true
    if [ -n "$2" ]; then
      systemctl try-restart labd.service >/dev/null 2>&1 || true
    fi
  fi
  if [ -z "$2" ]; then
    echo "labsync: set up /etc/labsync/labd.toml (labd init makes a cluster's), check with"
    echo "  labd doctor --config /etc/labsync/labd.toml"
    echo "then: systemctl enable --now labd"
  fi
fi
exit 0
EOF
cat > "$deb_root/DEBIAN/prerm" <<'EOF'
#!/bin/sh
# labsync's prerm: labd stopped when the package is removed (not on an
# upgrade: postinst restarts it). Its running jobs go on (KillMode=process).
set -e
if [ "$1" = remove ] && [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
  systemctl stop labd.service >/dev/null 2>&1 || true
fi
exit 0
EOF
cat > "$deb_root/DEBIAN/postrm" <<'EOF'
#!/bin/sh
# labsync's postrm: the unit forgotten. The state (/var/lib/labsync) and the
# cache (/var/cache/labsync) stay, as they hold jobs' records; so do the
# secrets labd init wrote. A purge removes /etc/labsync/labd.toml (dpkg does,
# for a conffile) and nothing else: remove the rest by hand once done.
set -e
if [ -z "$DPKG_ROOT" ] && [ -d /run/systemd/system ]; then
  systemctl daemon-reload >/dev/null 2>&1 || true
fi
exit 0
EOF
chmod 755 "$deb_root/DEBIAN/postinst" "$deb_root/DEBIAN/prerm" "$deb_root/DEBIAN/postrm"
deb="$out/labsync_${version}-1_${arch_deb}.deb"
dpkg-deb --root-owner-group -Zgzip --build "$deb_root" "$deb" >/dev/null
rm -rf "$deb_root"
echo "package.sh: $deb (needs glibc $glibc_min or newer)"

# --- tarball ------------------------------------------------------------
tar_root="$out/labsync-$version"
rm -rf "$tar_root"
cp -a "$stage" "$tar_root"
mv "$tar_root/etc/labsync/labd.toml" "$tar_root/etc/labsync/labd.toml.example"
tarball="$out/labsync-$version-$arch-linux-gnu.tar.gz"
tar -C "$tar_root" --owner=0 --group=0 -czf "$tarball" usr lib etc
rm -rf "$tar_root"
echo "package.sh: $tarball (sudo tar -C / -xzf it; then cp /etc/labsync/labd.toml.example /etc/labsync/labd.toml)"

# --- .rpm ---------------------------------------------------------------
if [ "$rpm" = 1 ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
  if ! cargo generate-rpm --help >/dev/null 2>&1; then
    echo "package.sh: installing cargo-generate-rpm (~3 min, once)" >&2
    cargo install --locked cargo-generate-rpm@0.21.1
  fi
  rpm_out="$out/labsync-$version-1.$arch.rpm"
  # The assets are the staged tree's; the metadata is crates/cli's
  # [package.metadata.generate-rpm], with the glibc read above.
  cargo generate-rpm -p crates/cli --target-dir "$out/rpm-target" \
    -s "requires = { glibc = \">= $glibc_min\" }" \
    -s "assets = [
      { source = \"$stage/usr/bin/labsync\", dest = \"/usr/bin/labsync\", mode = \"755\" },
      { source = \"$stage/usr/bin/labrun\", dest = \"/usr/bin/labrun\", mode = \"755\" },
      { source = \"$stage/usr/bin/labd\", dest = \"/usr/bin/labd\", mode = \"755\" },
      { source = \"$stage/lib/systemd/system/labd.service\", dest = \"/usr/lib/systemd/system/labd.service\", mode = \"644\" },
      { source = \"$stage/etc/labsync/labd.toml\", dest = \"/etc/labsync/labd.toml\", mode = \"644\", config = \"noreplace\" },
      { source = \"$stage/usr/share/doc/labsync/README.md\", dest = \"/usr/share/doc/labsync/README.md\", mode = \"644\", doc = true },
      { source = \"$stage/usr/share/doc/labsync/docs/*\", dest = \"/usr/share/doc/labsync/docs/\", mode = \"644\", doc = true },
    ]" \
    -o "$rpm_out"
  echo "package.sh: $rpm_out"
fi
