"""DuckLake: the store's multi-writer backend (several processes or machines writing one store).

``--db ducklake:sqlite:meta.db`` (several processes on one machine) or ``--db ducklake:postgres:dbname=nkv
host=...`` (several machines) names the catalog; the Parquet data files go under the data path given when
the lake is created (DuckLake remembers it in the catalog, so later opens need only the catalog).

Extensions come from PyPI wheels (``pip install 'nestedkv-pipeline[lake]'``), loaded straight from the
installed wheel's file (nothing written to ~/.duckdb); without the wheel, DuckDB's own ``INSTALL`` is tried
for users online. The wheels are built for one DuckDB version: the ``[lake]`` extra pins it.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import duckdb

from pipeline.store.errors import one_line

PREFIX = "ducklake:"
ALIAS = "lake"  # the lake's name inside the connection (``USE lake``)
# Catalog kind -> the DuckDB extension that reads it (a DuckDB-file catalog needs none).
CATALOG_EXTENSIONS = {"sqlite": "sqlite_scanner", "postgres": "postgres_scanner", "duckdb": None}
FILE_CATALOGS = ("sqlite", "duckdb")
# DuckLake retries a commit that conflicts with another writer's newer snapshot on its own (waits
# 50 ms x 1.5^n, ~13 s over 12 tries); what it cannot retry (a catalog lock, a real conflict) the
# store retries as a whole transaction.
RETRY_SETTINGS = {"ducklake_max_retry_count": 12, "ducklake_retry_wait_ms": 50, "ducklake_retry_backoff": 1.5}
# Errors after which re-running the whole transaction can succeed.
RETRYABLE = ("failed to commit ducklake transaction", "database is locked", "conflict", "could not serialize",
             "deadlock detected", "retry")
INSTALL_HINT = "pip install 'nestedkv-pipeline[lake]' (the extension wheels, pinned to their DuckDB version)"


class LakeSetupError(RuntimeError):
    """A lake that cannot be opened; the message is one line."""


def is_lake(db) -> bool:
    return str(db).startswith(PREFIX)


@dataclass(frozen=True)
class LakeSpec:
    """``ducklake:<catalog>:<target>``: a catalog kind and its file path or libpq connection string."""

    catalog: str
    target: str

    @classmethod
    def parse(cls, db: str) -> "LakeSpec":
        rest = str(db)[len(PREFIX):] if is_lake(db) else None
        kind, sep, target = (rest or "").partition(":")
        if rest is None or not sep or kind not in CATALOG_EXTENSIONS or not target.strip():
            raise LakeSetupError(f"--db {db!r}: a lake is ducklake:sqlite:PATH, ducklake:duckdb:PATH or "
                                 "ducklake:postgres:CONNINFO (e.g. 'dbname=nkv host=db.local')")
        return cls(kind, target.strip())

    def __str__(self) -> str:
        return f"{PREFIX}{self.catalog}:{self.target}"

    @property
    def is_file(self) -> bool:
        return self.catalog in FILE_CATALOGS

    def absolute(self) -> "LakeSpec":
        """File catalogs pinned to an absolute path (flow runs start elsewhere); conninfo kept as is."""
        return LakeSpec(self.catalog, str(Path(self.target).expanduser().resolve())) if self.is_file else self

    def exists(self) -> bool:
        """False only where we can tell: a file catalog that is not there."""
        return not self.is_file or Path(self.target).expanduser().exists()

    def extensions(self) -> list[str]:
        return ["ducklake"] + [e for e in [CATALOG_EXTENSIONS[self.catalog]] if e]


def _wheel_file(name: str, version: str) -> tuple[Optional[Path], str]:
    """The extension file in its PyPI wheel for this DuckDB version, or None and why not."""
    spec = importlib.util.find_spec(f"duckdb_extension_{name}")
    if spec is None or not spec.submodule_search_locations:
        return None, f"the wheel duckdb-extension-{name.replace('_', '-')} is not installed"
    root = Path(list(spec.submodule_search_locations)[0]) / "extensions"
    path = root / version / f"{name}.duckdb_extension"
    if path.is_file():
        return path, ""
    built = ", ".join(sorted(p.name for p in root.glob("v*"))) or "no version"
    return None, f"its wheel is built for DuckDB {built}, this is DuckDB {version}"


def load_extension(con: duckdb.DuckDBPyConnection, name: str) -> str:
    """Load extension ``name`` into ``con``: from its wheel, else what DuckDB has installed or can INSTALL.
    Returns where it came from; ``LakeSetupError`` (one line) when neither works."""
    version = con.execute("PRAGMA version").fetchone()[0]  # 'v1.5.5'
    path, why = _wheel_file(name, version)
    if path is not None:
        try:
            con.execute(f"LOAD '{path}'")
            return str(path)
        except duckdb.Error as e:
            why = f"loading {path} failed ({one_line(e)})"
    try:  # installed before, or online: DuckDB's own repository
        con.execute(f"INSTALL {name}")
        con.execute(f"LOAD {name}")
        return "duckdb install"
    except duckdb.Error as e:
        raise LakeSetupError(f"DuckLake needs the DuckDB extension {name!r}: {why}, and DuckDB could not "
                             f"install it ({one_line(e)}); {INSTALL_HINT}") from None


def _quote(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def connect(spec: LakeSpec, read_only: bool, data_path: Optional[str] = None,
            sandbox: Optional[dict] = None) -> duckdb.DuckDBPyConnection:
    """A connection with the lake attached as ``lake`` and in use.

    Writers get DuckLake's commit retry settings. Read-only connections are locked down after the
    attach with ``sandbox`` (the settings a file store opens with), less what DuckDB needs to read the
    lake: its data path stays readable (``allowed_directories``: without it, Parquet files committed after
    the attach are refused), and so does the catalog (an attached database's own file, or the Postgres
    connection). The catalog extension's table functions are refused per query
    (``sandbox.CATALOG_FUNCTIONS``).
    """
    # Autoload off: every extension is loaded explicitly (from the wheel), never fetched behind our back.
    con = duckdb.connect(config={"autoinstall_known_extensions": False, "autoload_known_extensions": False})
    try:
        for name in spec.extensions():
            load_extension(con, name)
        options = ["READ_ONLY"] if read_only else []
        if data_path and not read_only:
            options.append(f"DATA_PATH {_quote(_data_path(data_path))}")
        opts = f" ({', '.join(options)})" if options else ""
        try:
            retry_locked(lambda: con.execute(f"ATTACH {_quote(str(spec))} AS {ALIAS}{opts}"))
        except duckdb.Error as e:
            raise LakeSetupError(f"{spec}: cannot open the lake ({one_line(e)})") from None
        con.execute(f"USE {ALIAS}")
        if read_only:
            data = data_path_of(con)
            if data:
                con.execute(f"SET allowed_directories = [{_quote(data)}]")
            for key, value in (sandbox or {}).items():  # lock_configuration last: the dict keeps its order
                con.execute(f"SET {key} = {_sql_value(value)}")
        else:
            for key, value in RETRY_SETTINGS.items():
                con.execute(f"SET {key} = {value}")
        return con
    except BaseException:
        con.close()
        raise


def _data_path(path: str) -> str:
    """Local folders absolute and ending in '/' (DuckLake joins file names onto it); URLs kept."""
    if "://" in path:
        return path if path.endswith("/") else path + "/"
    p = Path(path).expanduser().resolve()
    p.mkdir(parents=True, exist_ok=True)
    return str(p) + "/"


def _sql_value(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else _quote(value) if isinstance(value, str) \
        else str(value)


def data_path_of(con: duckdb.DuckDBPyConnection) -> Optional[str]:
    """The data path the lake's catalog holds."""
    rows = con.execute(f"SELECT value FROM ducklake_options({_quote(ALIAS)}) WHERE option_name = 'data_path'"
                       ).fetchall()
    return rows[0][0] if rows else None


def is_locked(e: BaseException) -> bool:
    """A SQLite catalog is locked while another process commits (SQLite has no wait of its own here)."""
    return isinstance(e, duckdb.Error) and "database is locked" in str(e).lower()


def retry_locked(fn, tries: int = 130, first: float = 0.02, longest: float = 0.5):
    """``fn()``, tried again while the catalog is locked by other writers' commits (up to ~60 s: on a busy
    machine back-to-back commits of several writers kept a reader out for over 15 s)."""
    for attempt in range(tries):
        try:
            return fn()
        except duckdb.Error as e:
            if attempt == tries - 1 or not is_locked(e):
                raise
            time.sleep(min(first * 2 ** attempt, longest))


def is_retryable(e: BaseException) -> bool:
    msg = str(e).lower()
    return isinstance(e, duckdb.Error) and any(k in msg for k in RETRYABLE)
