#!/usr/bin/env bash
# Installs the system packages the farm runs on: redis-server (the cache and Celery broker)
# and bubblewrap (the compile sandbox). Debian/Ubuntu; does nothing when both are present.
set -euo pipefail
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v bwrap >/dev/null || missing+=(bubblewrap)
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing ${missing[*]} ..." >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
