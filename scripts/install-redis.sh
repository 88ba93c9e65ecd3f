#!/usr/bin/env bash
# Installs redis-server from the distribution when it is missing. It is not started here:
# the test fixtures and `make run` start their own instances.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null
    # Debian's package may start a system instance; Tidepool runs its own.
    ($SUDO service redis-server stop || true) >/dev/null 2>&1
elif command -v brew >/dev/null 2>&1; then
    brew install redis
else
    echo "install-redis: no apt-get or brew; install redis-server (>= 6.2) yourself" >&2
    exit 1
fi
command -v redis-server >/dev/null
