#!/usr/bin/env bash
# System prerequisites: Python 3.11 and redis-server (the embedded stack), chromium (the report test),
# promtool and npm (the alert rules and dashboards checks).
# Installs redis-server with apt-get where it is missing, or says exactly what to do.
set -euo pipefail

if ! command -v python3.11 >/dev/null 2>&1 && ! python3 -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  echo "rtrl needs Python 3.11 (python3.11 or python3 at 3.11) on PATH" >&2
  exit 1
fi

if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing redis-server with apt-get"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "redis-server is not installed and cannot be installed automatically here." >&2
    echo "Install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis) and re-run." >&2
    exit 1
  fi
fi

# Headless Chromium renders `rtrl report` in its test (tests/analytics/test_report_render.py).
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1 && ! command -v google-chrome >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing chromium with apt-get (for the report rendering test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: chromium is not installed; tests/analytics/test_report_render.py will fail until it is (apt-get install chromium)" >&2
  fi
fi

# For the tests and checks, not the demo: promtool (Debian's prometheus package) checks and
# unit-tests the alert rules (make check-alerts) and lints what the services export; npm installs
# the TypeScript SDK's and the dashboards' packages (make install-node).
for tool in promtool:prometheus npm:npm; do
  if ! command -v "${tool%%:*}" >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
      echo "installing ${tool#*:} with apt-get (for ${tool%%:*})"
      apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${tool#*:}" >/dev/null
    else
      echo "note: ${tool%%:*} is not installed; make test and make check need it (Debian/Ubuntu: sudo apt-get install ${tool#*:})" >&2
    fi
  fi
done
