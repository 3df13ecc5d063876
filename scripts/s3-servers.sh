#!/usr/bin/env bash
# Installs the S3-compatible servers of the store's compatibility matrix
# (README, "S3 servers") into target/s3-servers, from their package
# registries, and exports the variables the tests find them by. Sourced by
# scripts/test.sh; the tests start and stop every server themselves, on
# 127.0.0.1 only. Needs python3 (with venv) and npm; a server that cannot be
# installed is reported here, and the tests fail for it under CI.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/target/s3-servers"
mkdir -p "$root"

if [ ! -x "$root/venv/bin/moto_server" ] || [ ! -x "$root/venv/bin/ministack" ]; then
  echo "s3-servers.sh: installing moto server 5.2.5 and ministack 1.5.33 from PyPI (~1 min)" >&2
  python3 -m venv "$root/venv" &&
    "$root/venv/bin/pip" install --quiet --disable-pip-version-check \
      'moto[server]==5.2.5' 'ministack==1.5.33' ||
    echo "s3-servers.sh: could not install moto and ministack (python3 -m venv, pip)" >&2
fi
if [ ! -x "$root/npm/node_modules/.bin/s3rver" ]; then
  echo "s3-servers.sh: installing s3rver 3.7.1 from npm (~20 s)" >&2
  npm install --silent --no-audit --no-fund --prefix "$root/npm" s3rver@3.7.1 ||
    echo "s3-servers.sh: could not install s3rver (npm)" >&2
fi

for v in "LABSYNC_MOTO_SERVER=$root/venv/bin/moto_server" \
  "LABSYNC_MINISTACK=$root/venv/bin/ministack" \
  "LABSYNC_S3RVER=$root/npm/node_modules/.bin/s3rver"; do
  if [ -x "${v#*=}" ]; then
    export "${v?}"
  fi
done
