"""What a read-only store lets a query do: one SELECT, on a connection DuckDB itself sandboxes.

``nkv query`` runs a user's own SQL; it may read the store and nothing else (no other files, databases or
extensions, no settings changes). A query is refused before any of it runs.
"""

from __future__ import annotations

import json

import duckdb

from pipeline.store.errors import StoreError, one_line

# Read-only connections: DuckDB's own sandbox. No file but the store itself (COPY TO, EXPORT, ATTACH,
# read_text, INSTALL all fail), no extension loading, and no SET that could undo it.
SANDBOX = {
    "enable_external_access": False,
    "autoinstall_known_extensions": False,
    "autoload_known_extensions": False,
    "allow_community_extensions": False,
    "lock_configuration": True,
}
# What a read-only query may be, by DuckDB's parser. SELECT includes WITH, VALUES, FROM-first queries,
# DESCRIBE, SHOW and SUMMARIZE (and table functions such as pragma_table_info('runs')).
READ_ONLY_STATEMENTS = frozenset({duckdb.StatementType.SELECT})
# On a lake: postgres_scan/postgres_query/sqlite_scan reach any database the reader's network and
# credentials allow, and DuckDB's sandbox does not stop them (no setting disables a loaded extension's
# functions).
CATALOG_FUNCTIONS = ("postgres_", "sqlite_")


def refused_functions(con: duckdb.DuckDBPyConnection, sql: str) -> list[str]:
    """The catalog extensions' functions that one SELECT calls anywhere (by DuckDB's own parse tree)."""
    tree = json.loads(con.execute("SELECT json_serialize_sql(?)", [sql]).fetchone()[0])
    if tree.get("error"):
        return ["(a query DuckDB cannot serialize)"]

    def names(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "function_name" and isinstance(value, str):
                    yield value
                yield from names(value)
        elif isinstance(node, list):
            for value in node:
                yield from names(value)

    return sorted({n for n in names(tree) if n.lower().startswith(CATALOG_FUNCTIONS)})


def check_read_only(con: duckdb.DuckDBPyConnection, sql: str, path, on_lake: bool) -> None:
    """Refuse, before running anything, all but exactly one statement of a ``READ_ONLY_STATEMENTS`` kind."""
    try:
        statements = con.extract_statements(sql)
    except duckdb.Error as e:
        raise StoreError(f"{path}: query failed: {one_line(e)}") from None
    if len(statements) != 1:
        raise StoreError(f"{path}: store is open read-only; a query must be exactly one SELECT "
                         f"statement, found {len(statements)}")
    kind = statements[0].type
    if kind not in READ_ONLY_STATEMENTS:
        raise StoreError(f"{path}: store is open read-only; {kind.name} statements are refused "
                         "(SELECT, WITH, VALUES, DESCRIBE, SHOW and SUMMARIZE are allowed)")
    if on_lake:
        try:
            refused = refused_functions(con, sql)
        except duckdb.Error as e:
            raise StoreError(f"{path}: query failed: {one_line(e)}") from None
        if refused:
            raise StoreError(f"{path}: store is open read-only; {', '.join(refused)} reach other "
                             "databases and are refused")
