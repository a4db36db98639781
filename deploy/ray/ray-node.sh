#!/usr/bin/env bash
# Starts Ray on this node with its GPU memory as the custom resource `vramd_memory_mib`: the figure
# comes from the node's vramd daemon (`vramd ray-resources`: what it can still guarantee, in MiB).
# Start the daemon first; Ray's workers inherit VRAMD_SOCKET from this script's environment, so
# they become tenants of this node's daemon.
#
#   deploy/ray/ray-node.sh --head --port=6379          # the head node
#   deploy/ray/ray-node.sh --address=HEAD:6379         # every other node
#
# Every argument goes on to `ray start`. It must not get --resources too: for other custom
# resources as well, run `ray start --resources` yourself with them and this output merged.
# VRAMD_SOCKET names the daemon's socket (default /run/vramd/vramd.sock); `vramd` and `ray` are
# looked up on PATH.
set -euo pipefail
resources=$(vramd ray-resources)
exec ray start --resources "$resources" "$@"
