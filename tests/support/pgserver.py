"""Throwaway PostgreSQL servers for tests, started from the machine's own binaries.

`PostgresServer` runs `initdb` into a fresh temporary directory and `pg_ctl start`s a server
listening on 127.0.0.1 at a free TCP port, with its unix socket inside that directory. Tests
use it to exercise the Stash's Postgres backend against a real server, to restart it during a
stream of appends, and to kill other sessions' connections (`pg_terminate_backend`).

Invariants:
- Everything the server writes lives under one temporary directory (`base_dir`); `cleanup()`
  stops the server and deletes it. If the test process dies without cleaning up (SIGKILL),
  a watchdog shell process notices the end of its stdin pipe, stops the server with
  `-m immediate` and deletes the directory, so no orphan server outlives its owner.
- Durability settings are production-like: `fsync`, `synchronous_commit` and
  `full_page_writes` are on (tests check that acknowledged commits survive restarts);
  only `shared_buffers` is small and WAL is `minimal`, which changes no commit guarantee.
- The port and data directory never change across `stop()`/`start()`/`restart()`, so URLs
  handed out before a restart stay valid after it.
- Authentication is `scram-sha-256` for TCP and socket connections; the superuser's password
  is random per server and never appears in `repr()`, in log lines or in error messages
  produced here (`safe_url()` gives a masked URL for messages).
- PostgreSQL refuses to run as root. When this process is root, every server process runs as
  an unprivileged user (`postgres` if it exists, else a system user `stashpg` created on
  first use), with no supplementary groups, and the temporary directory is owned by it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
import urllib.parse
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

__all__ = [
    "REQUIRED_BINARIES",
    "PostgresServer",
    "PostgresUnavailable",
    "find_postgres_bin_dir",
]

REQUIRED_BINARIES: tuple[str, ...] = ("initdb", "pg_ctl", "postgres")
"""The executables a server needs; all three must sit in one directory."""

StopMode = Literal["smart", "fast", "immediate"]

_DBNAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_USERNAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_FALLBACK_RUN_AS = "stashpg"
_PORT_IN_USE_MARKERS = ("could not bind", "Address already in use", "could not create any TCP/IP")

# The watchdog: waits for its stdin to close; unless it first read "dismiss", the owner died
# without cleaning up, so it stops the server ($1 = pg_ctl, $2 = data dir) and removes $3.
_WATCHDOG_SCRIPT = """
IFS= read -r line || true
[ "$line" = "dismiss" ] && exit 0
"$1" stop -D "$2" -m immediate -s -w -t 30 >/dev/null 2>&1
rm -rf -- "$3"
"""

_LIVE_SERVERS: weakref.WeakSet[PostgresServer] = weakref.WeakSet()


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be had: binaries missing, or initdb / start failed.

    Raised by `PostgresServer` so that fixtures can tell "no server on this machine"
    (skip, or fail under CI) apart from bugs in the code under test.
    """


def find_postgres_bin_dir(extra_dirs: Sequence[str | os.PathLike[str]] = ()) -> Path | None:
    """Return the first directory holding executable `initdb`, `pg_ctl` and `postgres`.

    Search order: `extra_dirs`, `$PG_BINDIR`, the directory of `initdb` on `PATH` (symlinks
    resolved, so `/usr/local/bin/initdb -> /usr/lib/postgresql/15/bin/initdb` yields the
    latter), `/usr/lib/postgresql/<version>/bin` newest version first, `/usr/local/pgsql/bin`,
    `/usr/local/bin`. The same order as `scripts/ensure_postgres.sh`. Returns None when no
    directory has all three.
    """
    candidates: list[Path] = [Path(d) for d in extra_dirs]
    env_dir = os.environ.get("PG_BINDIR")
    if env_dir:
        candidates.append(Path(env_dir))
    on_path = shutil.which("initdb")
    if on_path:
        candidates.append(Path(on_path).resolve().parent)

    def version_key(p: Path) -> tuple[int, ...]:
        return tuple(int(x) for x in re.findall(r"\d+", p.parent.name)) or (0,)

    debian = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=version_key, reverse=True)
    candidates.extend(debian)
    candidates.extend([Path("/usr/local/pgsql/bin"), Path("/usr/local/bin")])
    for directory in candidates:
        if all(os.access(directory / name, os.X_OK) for name in REQUIRED_BINARIES):
            return directory
    return None


def _free_port(host: str) -> int:
    """A TCP port on `host` that nothing listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _conf_quote(value: str) -> str:
    """Quote a string for postgresql.conf (single quotes, embedded quotes doubled)."""
    return "'" + value.replace("'", "''") + "'"


def _ensure_run_as_user(name: str | None) -> pwd.struct_passwd:
    """The unprivileged account server processes run as when this process is root.

    `name` (or `$STASH_PG_RUN_AS`) if given; else `postgres` if it exists; else a system
    user `stashpg`, created with `useradd` on first use. Raises `PostgresUnavailable` if
    the account is root or cannot be created.
    """
    wanted = name or os.environ.get("STASH_PG_RUN_AS")
    if wanted:
        try:
            entry = pwd.getpwnam(wanted)
        except KeyError:
            entry = _create_system_user(wanted)
    else:
        try:
            entry = pwd.getpwnam("postgres")
        except KeyError:
            try:
                entry = pwd.getpwnam(_FALLBACK_RUN_AS)
            except KeyError:
                entry = _create_system_user(_FALLBACK_RUN_AS)
    if entry.pw_uid == 0:
        raise PostgresUnavailable(
            f"postgres: cannot run the server as {entry.pw_name!r}: it is uid 0, and "
            "PostgreSQL refuses to run as root; name an unprivileged user"
        )
    return entry


def _create_system_user(name: str) -> pwd.struct_passwd:
    """Create an unprivileged system account `name` with no home and no login shell."""
    if not _USERNAME_RE.match(name):
        raise PostgresUnavailable(f"postgres: refusing to create user {name!r}: invalid name")
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    nologin = shutil.which("nologin") or "/usr/sbin/nologin"
    proc = subprocess.run(
        [useradd, "--system", "--no-create-home", "--home-dir", "/nonexistent"]
        + ["--shell", nologin, "--user-group", name],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return pwd.getpwnam(name)  # also covers a concurrent creation by another process
    except KeyError:
        raise PostgresUnavailable(
            f"postgres: could not create the unprivileged user {name!r} to run the server "
            f"(PostgreSQL refuses to run as root): {useradd} exited {proc.returncode}: "
            f"{proc.stderr.strip()}"
        ) from None


def _traversable_by_others(path: Path) -> bool:
    """True if every directory from / down to `path` is searchable by any user."""
    current = path.resolve()
    for directory in [current, *current.parents]:
        try:
            mode = directory.stat().st_mode
        except OSError:
            return False
        if not mode & stat.S_IXOTH:
            return False
    return True


class PostgresServer:
    """A throwaway PostgreSQL server in a temporary directory, on 127.0.0.1 and a free port.

    Construction runs `initdb` and (unless `start=False`) starts the server and waits until
    it accepts password-authenticated connections; that takes about 1-3 s. Use as a context
    manager or call `cleanup()`.

    Args:
        bin_dir: directory of `initdb`/`pg_ctl`/`postgres`; found by
            `find_postgres_bin_dir()` when None.
        user: name of the superuser role created by initdb.
        password: its password; random (32 url-safe characters) when None.
        base_dir: parent of the temporary directory; `$STASH_PG_TMPDIR`, else the system
            temp dir. When running as root it must be searchable by the unprivileged user;
            if it is not, `/tmp` is used instead.
        run_as: unprivileged account to run the server as when this process is root
            (see `_ensure_run_as_user`); ignored when not root.
        shared_buffers: the server's `shared_buffers`, e.g. "16MB".
        max_connections: the server's `max_connections`.
        extra_settings: more postgresql.conf settings, name -> value (strings are quoted).
        start: start the server now.
        timeout: seconds to wait for initdb, start and stop each.

    Raises:
        PostgresUnavailable: binaries missing, initdb failed, or the server did not start.

    Idea: pytest-postgresql's "executor" (initdb + pg_ctl in a temp dir), reduced to what
    the stash tests need, plus restart and crash-stop for durability tests.
    """

    def __init__(
        self,
        *,
        bin_dir: str | os.PathLike[str] | None = None,
        user: str = "stash_test",
        password: str | None = None,
        base_dir: str | os.PathLike[str] | None = None,
        run_as: str | None = None,
        shared_buffers: str = "16MB",
        max_connections: int = 200,
        extra_settings: dict[str, str | int | float | bool] | None = None,
        start: bool = True,
        timeout: float = 60.0,
    ) -> None:
        if not _USERNAME_RE.match(user):
            raise ValueError(f"postgres: invalid superuser name {user!r} (want [a-z_][a-z0-9_]*)")
        found = Path(bin_dir) if bin_dir is not None else find_postgres_bin_dir()
        if found is None or not all(os.access(found / name, os.X_OK) for name in REQUIRED_BINARIES):
            where = str(found) if found is not None else "PATH, /usr/lib/postgresql/*/bin"
            raise PostgresUnavailable(
                f"postgres: server binaries {', '.join(REQUIRED_BINARIES)} not found in "
                f"{where}; run scripts/ensure_postgres.sh or set PG_BINDIR"
            )
        self.bin_dir: Path = found
        self.host: str = "127.0.0.1"
        self.user: str = user
        self._password: str = password if password is not None else secrets.token_urlsafe(24)
        self.timeout: float = timeout
        self._run_as: pwd.struct_passwd | None = (
            _ensure_run_as_user(run_as) if os.geteuid() == 0 else None
        )
        parent = Path(base_dir or os.environ.get("STASH_PG_TMPDIR") or tempfile.gettempdir())
        if self._run_as is not None and not _traversable_by_others(parent):
            parent = Path("/tmp")
        self.base_dir: Path = Path(tempfile.mkdtemp(prefix="stash-pg-", dir=parent))
        self.data_dir: Path = self.base_dir / "data"
        self.socket_dir: Path = self.base_dir / "sock"
        self.log_path: Path = self.base_dir / "server.log"
        self.port: int = _free_port(self.host)
        self._settings: dict[str, str | int | float | bool] = {
            "shared_buffers": shared_buffers,
            "max_connections": max_connections,
            **(extra_settings or {}),
        }
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._cleaned = False
        self._owner_pid = os.getpid()
        _LIVE_SERVERS.add(self)
        try:
            self.socket_dir.mkdir(mode=0o700)
            self._chown(self.base_dir)
            self._chown(self.socket_dir)
            self._start_watchdog()
            self._initdb()
            if start:
                self._first_start()
        except BaseException:
            self.cleanup()
            raise

    # ----------------------------------------------------------------- public API

    @property
    def password(self) -> str:
        """The superuser's password (kept out of `repr()`)."""
        return self._password

    def __repr__(self) -> str:
        return (
            f"PostgresServer(host={self.host!r}, port={self.port}, user={self.user!r}, "
            f"password='***', data_dir={str(self.data_dir)!r})"
        )

    def __enter__(self) -> PostgresServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cleanup()

    def url(self, dbname: str = "postgres") -> str:
        """SQLAlchemy URL `postgresql+psycopg://user:password@127.0.0.1:port/dbname` (str).

        Holds the password: never log it; use `safe_url()` in messages.
        """
        _check_dbname(dbname)
        user = urllib.parse.quote(self.user, safe="")
        password = urllib.parse.quote(self._password, safe="")
        return f"postgresql+psycopg://{user}:{password}@{self.host}:{self.port}/{dbname}"

    def safe_url(self, dbname: str = "postgres") -> str:
        """`url(dbname)` with the password replaced by `***`, for messages and logs."""
        _check_dbname(dbname)
        return f"postgresql+psycopg://{self.user}:***@{self.host}:{self.port}/{dbname}"

    def conninfo(self, dbname: str = "postgres", **params: Any) -> str:
        """A libpq connection string for `psycopg.connect` (TCP, password included)."""
        _check_dbname(dbname)
        params.setdefault("connect_timeout", 10)
        return make_conninfo(
            host=self.host,
            port=self.port,
            user=self.user,
            password=self._password,
            dbname=dbname,
            **params,
        )

    def connect(
        self, dbname: str = "postgres", *, autocommit: bool = True
    ) -> psycopg.Connection[Any]:
        """Open a psycopg 3 connection as the superuser (autocommit by default).

        Raises psycopg.OperationalError if the server is down.
        """
        return psycopg.connect(self.conninfo(dbname), autocommit=autocommit)

    def create_database(self, name: str) -> str:
        """Create database `name` (from template0) and return its `url()`.

        `name` must match `[A-Za-z_][A-Za-z0-9_]{0,62}`; raises ValueError otherwise and
        psycopg.errors.DuplicateDatabase if it exists.
        """
        _check_dbname(name)
        with self.connect() as conn:
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE template0 ENCODING 'UTF8'").format(
                    sql.Identifier(name)
                )
            )
        return self.url(name)

    def drop_database(self, name: str, *, force: bool = True) -> None:
        """Drop database `name` if it exists; `force` first ends its sessions (PG >= 13)."""
        _check_dbname(name)
        statement = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name))
        if force:
            statement = statement + sql.SQL(" WITH (FORCE)")
        with self.connect() as conn:
            conn.execute(statement)

    def terminate_backends(self, dbname: str, *, wait: bool = True) -> int:
        """`pg_terminate_backend` every other client session connected to `dbname`.

        Background workers (autovacuum) are left alone. Returns how many sessions were signalled. With `wait`, returns only once they are
        gone from `pg_stat_activity` (at most `timeout` seconds; TimeoutError after that).
        """
        _check_dbname(dbname)
        with self.connect() as conn:
            rows = conn.execute(
                "SELECT pid, pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()"
                " AND backend_type = 'client backend'",
                (dbname,),
            ).fetchall()
            pids = [int(pid) for pid, signalled in rows if signalled]
            deadline = time.monotonic() + self.timeout
            while wait and pids:
                (remaining,) = conn.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s)", (pids,)
                ).fetchone() or (0,)
                if remaining == 0:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"postgres: {remaining} terminated session(s) of database {dbname!r} "
                        f"still present after {self.timeout} s"
                    )
                time.sleep(0.01)
        return len(pids)

    def is_running(self) -> bool:
        """True if `pg_ctl status` finds a live postmaster for the data directory."""
        proc = self._run([self._bin("pg_ctl"), "status", "-D", str(self.data_dir)], check=False)
        return proc.returncode == 0

    def start(self) -> None:
        """Start the server (same port and data directory as before) and wait until it
        accepts password-authenticated connections. No-op if already running.

        Raises PostgresUnavailable if it does not come up within `timeout` seconds; the
        message holds the tail of the server log.
        """
        self._check_not_cleaned()
        if self.is_running():
            return
        self._pg_ctl_start()
        self._wait_ready()

    def stop(self, mode: StopMode = "fast") -> None:
        """Stop the server and wait until it is down. No-op if it is not running.

        `fast` rolls back open transactions and checkpoints; `immediate` aborts every
        process without a checkpoint, like a crash (the next start runs WAL recovery);
        `smart` waits for sessions to end.
        """
        if mode not in ("smart", "fast", "immediate"):
            raise ValueError(f"postgres: unknown stop mode {mode!r} (smart, fast, immediate)")
        if self._cleaned or not self.data_dir.exists() or not self.is_running():
            return
        proc = self._run(
            [self._bin("pg_ctl"), "stop", "-D", str(self.data_dir), "-m", mode, "-w"]
            + ["-t", str(int(self.timeout)), "-s"],
            check=False,
        )
        if proc.returncode != 0 and self.is_running():
            raise RuntimeError(
                f"postgres: pg_ctl stop -m {mode} failed (exit {proc.returncode}): "
                f"{proc.stderr.strip()}\n{self.log_tail()}"
            )

    def restart(self, mode: StopMode = "fast") -> None:
        """`stop(mode)` then `start()`: same port, same data, new server processes."""
        self.stop(mode)
        self.start()

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines of the server log ("" if there is none yet)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def cleanup(self) -> None:
        """Stop the server (immediate) and delete the temporary directory. Idempotent."""
        if self._cleaned:
            return
        try:
            with contextlib.suppress(Exception):
                self.stop("immediate")
            shutil.rmtree(self.base_dir, ignore_errors=True)
        finally:
            self._cleaned = True
            self._dismiss_watchdog()
            _LIVE_SERVERS.discard(self)

    # ----------------------------------------------------------------- internals

    def _check_not_cleaned(self) -> None:
        if self._cleaned:
            raise RuntimeError("postgres: this server was cleaned up; create a new one")

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def _chown(self, path: Path) -> None:
        if self._run_as is not None:
            os.chown(path, self._run_as.pw_uid, self._run_as.pw_gid)

    def _env(self) -> dict[str, str]:
        # A clean environment: no PG* variables of the caller leak into initdb/pg_ctl.
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LC_ALL": "C",
            "LANG": "C",
            "TZ": "UTC",
            "HOME": str(self.base_dir),
        }

    def _user_kwargs(self) -> dict[str, Any]:
        if self._run_as is None:
            return {}
        return {
            "user": self._run_as.pw_uid,
            "group": self._run_as.pw_gid,
            "extra_groups": [],
        }

    def _run(self, args: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a PostgreSQL tool as the server's account, capturing output."""
        proc = subprocess.run(
            args,
            cwd=self.base_dir,
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=self.timeout + 10,
            stdin=subprocess.DEVNULL,
            check=False,
            **self._user_kwargs(),
        )
        if check and proc.returncode != 0:
            raise PostgresUnavailable(
                f"postgres: {Path(args[0]).name} {args[1] if len(args) > 1 else ''} failed "
                f"(exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()}"
            )
        return proc

    def _start_watchdog(self) -> None:
        self._watchdog = subprocess.Popen(
            ["sh", "-c", _WATCHDOG_SCRIPT, "stash-pg-watchdog"]
            + [self._bin("pg_ctl"), str(self.data_dir), str(self.base_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd="/",
            env=self._env(),
            start_new_session=True,
            **self._user_kwargs(),
        )

    def _dismiss_watchdog(self) -> None:
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is None or watchdog.stdin is None:
            return
        with contextlib.suppress(OSError):
            watchdog.stdin.write(b"dismiss\n")
        with contextlib.suppress(OSError):
            watchdog.stdin.close()
        try:
            watchdog.wait(timeout=5)
        except subprocess.TimeoutExpired:
            watchdog.kill()
            watchdog.wait()

    def _initdb(self) -> None:
        pwfile = self.base_dir / "pwfile"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self._password + "\n")
        self._chown(pwfile)
        try:
            self._run(
                [
                    self._bin("initdb"),
                    "-D",
                    str(self.data_dir),
                    "--username",
                    self.user,
                    "--pwfile",
                    str(pwfile),
                    "--auth",
                    "scram-sha-256",
                    "--encoding",
                    "UTF8",
                    "--locale",
                    "C",
                    # initdb's own files need no fsync: a lost throwaway cluster is re-made.
                    "--no-sync",
                ]
            )
        finally:
            pwfile.unlink(missing_ok=True)
        conf = self.data_dir / "postgresql.conf"
        with conf.open("a") as f:
            f.write("\n# Added by tests/pgserver.py\ninclude 'stash_test.conf'\n")
        self._write_settings()

    def _write_settings(self) -> None:
        settings: dict[str, str | int | float | bool] = {
            "listen_addresses": self.host,
            "port": self.port,
            "unix_socket_directories": str(self.socket_dir),
            "unix_socket_permissions": "0700",
            "fsync": True,
            "synchronous_commit": "on",
            "full_page_writes": True,
            "wal_level": "minimal",
            "max_wal_senders": 0,
            "password_encryption": "scram-sha-256",
            "logging_collector": False,
            "log_min_messages": "warning",
            "log_line_prefix": "%m [%p] %q%u@%d ",
            "timezone": "UTC",
            "lc_messages": "C",
            "max_parallel_workers_per_gather": 0,
            **self._settings,
        }
        lines = []
        for name, value in settings.items():
            if isinstance(value, bool):
                text = "on" if value else "off"
            elif isinstance(value, int | float):
                text = str(value)
            else:
                text = _conf_quote(value)
            lines.append(f"{name} = {text}\n")
        path = self.data_dir / "stash_test.conf"
        path.write_text("".join(lines))
        self._chown(path)

    def _pg_ctl_start(self) -> subprocess.CompletedProcess[str]:
        return self._run(
            [self._bin("pg_ctl"), "start", "-D", str(self.data_dir), "-l", str(self.log_path)]
            + ["-w", "-t", str(int(self.timeout)), "-s"],
            check=False,
        )

    def _first_start(self) -> None:
        """Start on a fresh free port, retrying with another if one is taken meanwhile."""
        for _attempt in range(5):
            proc = self._pg_ctl_start()
            if proc.returncode == 0:
                self._wait_ready()
                return
            tail = self.log_tail()
            if not any(marker in tail for marker in _PORT_IN_USE_MARKERS):
                break
            self.port = _free_port(self.host)
            self._write_settings()
        raise PostgresUnavailable(
            f"postgres: server in {self.data_dir} did not start (pg_ctl exit {proc.returncode}):"
            f" {proc.stderr.strip()}\n--- server log ---\n{self.log_tail()}"
        )

    def _wait_ready(self) -> None:
        """Poll with a real password login until it succeeds or `timeout` passes."""
        deadline = time.monotonic() + self.timeout
        delay = 0.01
        while True:
            try:
                with self.connect() as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError as exc:
                if time.monotonic() > deadline:
                    raise PostgresUnavailable(
                        f"postgres: server at {self.safe_url()} not accepting connections "
                        f"after {self.timeout} s: {exc}\n--- server log ---\n{self.log_tail()}"
                    ) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def _check_dbname(name: str) -> None:
    if not isinstance(name, str) or not _DBNAME_RE.match(name):
        raise ValueError(
            f"postgres: invalid database name {name!r} (want [A-Za-z_][A-Za-z0-9_]{{0,62}})"
        )


@atexit.register
def _cleanup_live_servers() -> None:
    # Only in the process that made the server: a forked child exiting normally must not
    # stop its parent's server.
    for server in list(_LIVE_SERVERS):
        if server._owner_pid == os.getpid():
            with contextlib.suppress(Exception):
                server.cleanup()


def iter_live_servers() -> Iterator[PostgresServer]:
    """Servers created in this process and not yet cleaned up (for diagnostics)."""
    return iter(list(_LIVE_SERVERS))
