#!/usr/bin/env bash
# ensure_java.sh: make sure a Java runtime >= 17 is available (PySpark 4 needs Java 17 or 21).
#
# Invariants:
# - Idempotent: when a suitable java is present it installs nothing and prints one line
#   with its version and path.
# - The java checked is the one PySpark will use: $JAVA_HOME/bin/java when JAVA_HOME is set,
#   otherwise `java` on PATH.
# - When java is missing or older than 17 (and JAVA_HOME is not set) it runs
#   `apt-get update && apt-get install -y openjdk-17-jre-headless` (the Debian 12 package),
#   then checks again.
# - Exits 0 only when the java PySpark will use reports a major version >= 17; otherwise exits 1
#   with a message saying what was found.
set -euo pipefail

MIN_MAJOR=17
PACKAGE=openjdk-17-jre-headless

java_bin() {
    if [ -n "${JAVA_HOME:-}" ]; then
        printf '%s\n' "$JAVA_HOME/bin/java"
    else
        command -v java 2>/dev/null || true
    fi
}

# Prints the quoted version string of `java -version` (e.g. 17.0.15 or 1.8.0_392), or nothing.
java_version() {
    local bin="$1"
    [ -n "$bin" ] && [ -x "$bin" ] || return 0
    "$bin" -version 2>&1 | sed -n 's/^.* version "\([^"]*\)".*$/\1/p' | head -n 1
}

# Major version of a version string: 1.8.0_392 -> 8, 17.0.15 -> 17, 21 -> 21.
major_of() {
    local v="$1"
    case "$v" in
        1.*) v="${v#1.}" ;;
    esac
    v="${v%%[!0-9]*}"
    printf '%s\n' "${v:-0}"
}

check() {
    local bin version major
    bin="$(java_bin)"
    version="$(java_version "$bin")"
    [ -n "$version" ] || return 1
    major="$(major_of "$version")"
    if [ "$major" -ge "$MIN_MAJOR" ]; then
        echo "ensure_java: JAVA version $version (major $major) at $bin"
        return 0
    fi
    echo "ensure_java: java at $bin is version $version (major $major), older than $MIN_MAJOR" >&2
    return 1
}

if check; then
    exit 0
fi

if [ -n "${JAVA_HOME:-}" ]; then
    echo "ensure_java: error: JAVA_HOME=$JAVA_HOME does not hold a Java >= $MIN_MAJOR (PySpark uses JAVA_HOME when it is set); point it at Java $MIN_MAJOR+ or unset it" >&2
    exit 1
fi

echo "ensure_java: no Java >= $MIN_MAJOR on PATH; installing $PACKAGE" >&2
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_java: error: apt-get is not available; install a Java runtime >= $MIN_MAJOR by hand" >&2
    exit 1
fi
if [ "$(id -u)" -eq 0 ]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    as_root=(sudo -n)
else
    echo "ensure_java: error: installing $PACKAGE needs root (not root, and passwordless sudo is not available)" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# The Debian JRE's postinst needs the man directory, which slim images delete.
mkdir -p /usr/share/man/man1 2>/dev/null || true
if ! "${as_root[@]}" apt-get update -qq >&2; then
    echo "ensure_java: error: apt-get update failed" >&2
    exit 1
fi
if ! "${as_root[@]}" apt-get install -y -qq --no-install-recommends "$PACKAGE" >&2; then
    echo "ensure_java: error: apt-get install -y $PACKAGE failed" >&2
    exit 1
fi
# A newly installed JRE may not be the `java` alternative yet; prefer the newest >= 17.
if ! check; then
    for candidate in $(ls -d /usr/lib/jvm/*/bin/java 2>/dev/null | sort -V -r); do
        major="$(major_of "$(java_version "$candidate")")"
        if [ "$major" -ge "$MIN_MAJOR" ] && command -v update-alternatives >/dev/null 2>&1; then
            "${as_root[@]}" update-alternatives --set java "$candidate" >&2 || true
            break
        fi
    done
    if check; then
        exit 0
    fi
    echo "ensure_java: error: installed $PACKAGE but \`java -version\` still does not report >= $MIN_MAJOR" >&2
    exit 1
fi
