"""The project's own questions to a store, by name: what resume skips, a batch's and a fan-out's totals,
the report, the ablation, the benchmarks and the suite. Callers ask by name; the SQL lives here.
"""

from __future__ import annotations

from typing import Sequence

from pipeline.config import RunConfig
from pipeline.results import OK
from pipeline.store.reads import Reads


class Queries(Reads):
    # -- resume -----------------------------------------------------------------------------------
    def done_documents(self, config: RunConfig) -> set[tuple[str, str]]:
        """(doc_id, content_sha256) of documents answered ok (every question) under this exact configuration,
        in any run. Resume skips by this pair: the same text under a new doc_id still gets its own rows."""
        with self._session():
            rows = self._read(lambda: self.con.execute(
                """
                SELECT DISTINCT o.doc_id, o.content_sha256 FROM outputs o JOIN runs r ON r.run_id = o.run_id
                WHERE r.config_hash = ?
                GROUP BY o.run_id, o.content_sha256, o.doc_id HAVING bool_and(o.status = ?)
                """,
                [config.config_hash(), OK],
            ).fetchall())
        return {(d, h) for d, h in rows}

    def evaluated_documents(self, config: RunConfig) -> list[dict]:
        """Per run and document with ok answers under ``config``: ``scored`` (it has evaluation rows) and
        ``no_gold`` (none of its questions has a gold answer)."""
        return self.query(
            """
            SELECT o.doc_id, o.content_sha256, bool_or(e.run_id IS NOT NULL) AS scored, bool_and(o.gold IS NULL) AS no_gold
            FROM outputs o JOIN runs r ON r.run_id = o.run_id
            LEFT JOIN evaluations e ON e.run_id = o.run_id AND e.doc_id = o.doc_id
            WHERE r.config_hash = $h AND o.status = 'ok'
            GROUP BY o.run_id, o.content_sha256, o.doc_id
            """,
            {"h": config.config_hash()},
        ).to_pylist()

    def latest_ok_runs(self, config: RunConfig) -> dict[str, str]:
        """content sha256 -> the latest run holding ok answers for it under ``config``."""
        rows = self.query(
            """
            SELECT content_sha256, arg_max(run_id, created_at) AS run_id FROM (
                SELECT o.content_sha256, o.run_id, any_value(r.created_at) AS created_at
                FROM outputs o JOIN runs r ON r.run_id = o.run_id
                WHERE r.config_hash = $h
                GROUP BY o.run_id, o.content_sha256, o.doc_id HAVING bool_and(o.status = 'ok')
            ) GROUP BY content_sha256
            """,
            {"h": config.config_hash()},
        ).to_pylist()
        return {r["content_sha256"]: r["run_id"] for r in rows}

    # -- savings ----------------------------------------------------------------------------------
    def memory_savings(self, run_ids: Sequence[str], columns: Sequence[str] = ("*",)) -> list[dict]:
        """``columns`` of the ``memory_savings`` view for these runs, by press and setting."""
        if not run_ids:
            return []
        return self.query(
            f"SELECT {', '.join(columns)} FROM memory_savings WHERE run_id IN (SELECT unnest(?)) "
            "ORDER BY press, compression_ratio, head_budget, budget, prefill, kv_bits", [list(run_ids)]).to_pylist()
