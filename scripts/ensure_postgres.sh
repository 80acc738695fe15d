#!/usr/bin/env bash
# ensure_postgres.sh: make sure the PostgreSQL server binaries (initdb, pg_ctl, postgres)
# are on this machine, so tests can start throwaway servers (tests/support/pgserver.py).
#
# Invariants:
# - Idempotent: when the binaries are present it installs nothing and prints one line
#   naming the directory that holds them and the server version.
# - When they are missing it runs `apt-get update && apt-get install -y postgresql`
#   (as root, or through sudo when available), then looks again.
# - Exits 0 only when all three binaries are executable in one directory; otherwise exits 1
#   with a message naming what is missing and why it could not be installed.
#
# Search order (the same as tests/support/pgserver.py): $PG_BINDIR, the directory of `initdb` on PATH
# (symlinks resolved), /usr/lib/postgresql/<newest>/bin, /usr/local/pgsql/bin, /usr/local/bin.
set -euo pipefail

have_all() {
    local dir="$1"
    [ -n "$dir" ] && [ -x "$dir/initdb" ] && [ -x "$dir/pg_ctl" ] && [ -x "$dir/postgres" ]
}

find_bin_dir() {
    local candidates=()
    if [ -n "${PG_BINDIR:-}" ]; then
        candidates+=("$PG_BINDIR")
    fi
    local on_path
    if on_path="$(command -v initdb 2>/dev/null)"; then
        candidates+=("$(dirname "$(readlink -f "$on_path")")")
    fi
    local d
    while IFS= read -r d; do
        candidates+=("$d")
    done < <(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V -r)
    candidates+=(/usr/local/pgsql/bin /usr/local/bin)
    for d in "${candidates[@]}"; do
        if have_all "$d"; then
            printf '%s\n' "$d"
            return 0
        fi
    done
    return 1
}

report() {
    local dir="$1"
    local version
    version="$("$dir/postgres" --version 2>/dev/null || echo 'postgres (unknown version)')"
    echo "ensure_postgres: initdb, pg_ctl, postgres found in $dir ($version)"
}

if dir="$(find_bin_dir)"; then
    report "$dir"
    exit 0
fi

echo "ensure_postgres: PostgreSQL server binaries (initdb, pg_ctl, postgres) not found; installing package postgresql" >&2

if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_postgres: error: apt-get is not available on this machine; install the PostgreSQL server binaries by hand or set PG_BINDIR to the directory holding initdb, pg_ctl and postgres" >&2
    exit 1
fi

if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "ensure_postgres: error: installing postgresql needs root (not root, and passwordless sudo is not available)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
if ! "${as_root[@]}" apt-get update -qq >&2; then
    echo "ensure_postgres: error: apt-get update failed" >&2
    exit 1
fi
if ! "${as_root[@]}" apt-get install -y -qq --no-install-recommends postgresql >&2; then
    echo "ensure_postgres: error: apt-get install -y postgresql failed" >&2
    exit 1
fi

if dir="$(find_bin_dir)"; then
    report "$dir"
    exit 0
fi
echo "ensure_postgres: error: package postgresql was installed but initdb, pg_ctl and postgres are still not found (looked in \$PG_BINDIR, PATH, /usr/lib/postgresql/*/bin, /usr/local/pgsql/bin, /usr/local/bin)" >&2
exit 1
