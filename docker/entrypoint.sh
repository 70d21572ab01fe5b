#!/usr/bin/env bash
# trainbox container entrypoint (run by tini, so signals reach the process exec'd below).
#
#   docker run IMAGE train gpt2-125m ...    -> trainbox train gpt2-125m ...
#   docker run IMAGE torchrun ... -m trainbox train ...  -> runs torchrun (any program on PATH runs as is)
#   docker run IMAGE                        -> trainbox doctor (the image's CMD)
#
# Before handing over it checks that the directories trainbox writes to are writable, because a host
# folder bind-mounted over them keeps the host's owner, and says how to fix that.
set -euo pipefail

fail() {
    echo "trainbox-entrypoint: $*" >&2
    exit 1
}

# A directory trainbox must write to: create it if missing, then check it is writable by this user.
need_writable() {
    local dir="$1" what="$2"
    [ -n "$dir" ] || return 0
    mkdir -p "$dir" 2>/dev/null || true
    if [ ! -w "$dir" ]; then
        fail "$what directory $dir is not writable by uid $(id -u); on the host run" \
             "'sudo chown -R $(id -u):$(id -g) <the folder mounted at $dir>' or start the container with --user \$(id -u):\$(id -g)"
    fi
}

# A cache directory: when it is not writable, fall back to a temporary one (slower: caches are lost).
want_writable() {
    local var="$1" dir="${!1:-}"
    [ -n "$dir" ] || return 0
    mkdir -p "$dir" 2>/dev/null || true
    if [ ! -w "$dir" ]; then
        local tmp
        tmp="$(mktemp -d "${TMPDIR:-/tmp}/trainbox-${var,,}.XXXXXX")"
        echo "trainbox-entrypoint: $var=$dir is not writable by uid $(id -u); using $tmp for this run" \
             "(chown the volume to $(id -u) to keep the cache between runs)" >&2
        export "$var=$tmp"
    fi
}

if [ "$#" -eq 0 ]; then
    set -- --help
fi

want_writable TORCHINDUCTOR_CACHE_DIR
want_writable TRITON_CACHE_DIR
want_writable HF_HOME
if [ -d runs ] || [ "${1:-}" = train ]; then
    need_writable "$PWD/runs" "run"
fi

# A program on PATH (torchrun, python, bash) runs as given; anything else is a trainbox verb.
if [ "${1:0:1}" != "-" ] && type -P "$1" >/dev/null; then
    exec "$@"
fi
exec trainbox "$@"
