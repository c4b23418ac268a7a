#!/bin/sh
# Each replica beats its heartbeat under its own name: the container's hostname,
# unless RTRL_INSTANCE is set.
export RTRL_INSTANCE="${RTRL_INSTANCE:-$(hostname)}"
exec "$@"
