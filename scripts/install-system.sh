#!/usr/bin/env bash
# System packages Tidepool needs, installed when missing:
# - redis-server (+ redis-tools): the pool. Not started here: tests and `make run` start their own.
# - docker-compose (client only, no engine): the tests validate compose.yaml with it.
# - openssl: the tests make a throwaway certificate for Redis over TLS.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server redis-tools)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
[ ${#need[@]} -eq 0 ] && exit 0

SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    # Debian's package may start a system Redis; Tidepool runs its own instances.
    ($SUDO service redis-server stop || true) >/dev/null 2>&1
elif command -v brew >/dev/null 2>&1; then
    brew install redis docker-compose openssl
else
    echo "install-system: no apt-get or brew; install ${need[*]} yourself" >&2
    exit 1
fi
command -v redis-server >/dev/null
