"""A throw-away PostgreSQL server for tests (any package's tests may use it).

    url, stop = start_postgres(tmp_dir)      # raises PostgresUnavailable without binaries
    db_url = create_database(url)            # a fresh, empty database on that server
    ...
    stop()

The server listens on a Unix socket in its own directory and on a free 127.0.0.1 port, trusts
local connections, and runs with fsync off (test data only). ``initdb`` refuses to run as root, so
as root the server runs as the ``postgres`` user through ``runuser``.
"""

from __future__ import annotations

import atexit
import glob
import logging
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import URL, make_url

log = logging.getLogger(__name__)

_SUPERUSER = "postgres"
_RUN_AS = "postgres"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server binaries (``initdb``, ``pg_ctl``) on this machine."""


def find_postgres_bin() -> Path | None:
    """The directory holding ``initdb`` and ``pg_ctl``: on PATH, else the newest Debian install."""
    on_path = shutil.which("initdb")
    if on_path and shutil.which("pg_ctl"):
        return Path(on_path).resolve().parent
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]
    found = [d for d in found if (d / "pg_ctl").exists()]
    if not found:
        return None
    return max(found, key=lambda d: _version_key(d.parent.name))


def _version_key(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in name.split(".") if p.isdigit())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _runner() -> tuple[list[str], pwd.struct_passwd | None]:
    if os.geteuid() != 0:
        return [], None
    try:
        user = pwd.getpwnam(_RUN_AS)
    except KeyError as e:
        raise RuntimeError(f"running as root and there is no {_RUN_AS!r} user to run PostgreSQL as") from e
    runuser = shutil.which("runuser")
    if runuser is None:
        raise RuntimeError("running as root and runuser is missing: cannot run initdb as another user")
    return [runuser, "-u", _RUN_AS, "--"], user


def _run(cmd: list[str], cwd: Path, timeout_s: float) -> None:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        program = next(Path(c).name for c in cmd if Path(c).name in ("initdb", "pg_ctl"))
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{program} failed: {' | '.join(tail)}")


def start_postgres(
    tmpdir: str | os.PathLike[str] | None = None, timeout_s: float = 60.0
) -> tuple[str, Callable[[], None]]:
    """Start a private PostgreSQL server; returns its superuser URL and a function that stops it.

    The server's files go in a new directory inside ``tmpdir`` (or the system temp dir when
    ``tmpdir`` is too deep for a socket path or, as root, not reachable by the server's user);
    ``stop()`` shuts the server down and deletes them, and also runs at interpreter exit.
    Raises :class:`PostgresUnavailable` when no PostgreSQL binaries exist.
    """
    bindir = find_postgres_bin()
    if bindir is None:
        raise PostgresUnavailable(
            "no PostgreSQL server binaries (initdb, pg_ctl) found on PATH or in /usr/lib/postgresql"
        )
    prefix, user = _runner()
    # Unix socket paths are limited to ~107 bytes; as root the server's user must reach the dir.
    parent = Path(tmpdir) if tmpdir is not None and user is None and len(str(tmpdir)) < 60 else None
    base = Path(tempfile.mkdtemp(prefix="moetune-pg-", dir=parent))
    data, sock, logfile = base / "data", base / "sock", base / "server.log"
    sock.mkdir()
    if user is not None:
        for p in (base, sock):
            os.chown(p, user.pw_uid, user.pw_gid)
    pg_ctl = [*prefix, str(bindir / "pg_ctl"), "-D", str(data)]
    started = False

    def stop() -> None:
        nonlocal started
        if started:
            started = False
            try:
                _run([*pg_ctl, "-m", "immediate", "-w", "stop"], base, timeout_s)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                log.warning("stopping the test PostgreSQL server: %s", e)
        shutil.rmtree(base, ignore_errors=True)

    atexit.register(stop)
    try:
        _run(
            [
                *prefix,
                str(bindir / "initdb"),
                "-D",
                str(data),
                "-U",
                _SUPERUSER,
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
                "--no-instructions",
            ],
            base,
            timeout_s,
        )
        for attempt in range(3):
            port = _free_port()
            options = (
                f"-c listen_addresses=127.0.0.1 -p {port} -k {sock} "
                "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=50"
            )
            try:
                _run(
                    [*pg_ctl, "-l", str(logfile), "-o", options, "-t", str(int(timeout_s)), "-w", "start"],
                    base,
                    timeout_s + 5,
                )
                break
            except RuntimeError:
                if attempt == 2:
                    raise
                log.info("test PostgreSQL did not start on port %d; retrying", port)
        started = True
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        server_log = logfile.read_text(errors="replace").strip().splitlines()[-3:] if logfile.exists() else []
        stop()
        raise RuntimeError(f"cannot start a test PostgreSQL server: {e} {' | '.join(server_log)}") from e
    url = URL.create(
        "postgresql+psycopg", username=_SUPERUSER, host="127.0.0.1", port=port, database="postgres"
    )
    log.info("test PostgreSQL server at %s (socket dir %s)", url.render_as_string(), sock)
    return url.render_as_string(hide_password=False), stop


def create_database(server_url: str, name: str | None = None) -> str:
    """Create an empty database on the server at ``server_url``; returns its URL."""
    import psycopg
    from psycopg import sql

    name = name or f"t_{uuid.uuid4().hex[:12]}"
    url = make_url(server_url)
    with psycopg.connect(
        host=url.host,
        port=url.port,
        user=url.username,
        password=url.password or None,
        dbname=url.database or "postgres",
        autocommit=True,
    ) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return url.set(database=name).render_as_string(hide_password=False)
