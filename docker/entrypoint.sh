#!/bin/sh
# The image's entry point: run `hlbp "$@"` as the unprivileged user hlbp (uid 10001), never as root.
#
# Started as root (the default), it first makes /data writable for hlbp: a volume or a bind-mounted host folder is
# often owned by root, and a peer that cannot write its identity, checkpoint or cache fails at once. Started as
# another user (`--user`), it runs hlbp as that user and leaves /data alone. Either way it execs, so hlbp is PID 1
# and gets SIGTERM itself.
set -eu
if [ "$(id -u)" = 0 ]; then
    mkdir -p /data
    if [ "$(stat -c %u /data)" != 10001 ]; then
        chown 10001:10001 /data
    fi
    for dir in "${HLBP_CACHE:-}" "${HLBP_OUT_DIR:-}"; do
        case "$dir" in
            /data/*) mkdir -p "$dir" && chown 10001:10001 "$dir" ;;
        esac
    done
    exec setpriv --reuid=10001 --regid=10001 --init-groups --inh-caps=-all env HOME=/home/hlbp hlbp "$@"
fi
exec hlbp "$@"
