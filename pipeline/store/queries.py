"""The project's own questions to a store, by name: what resume skips, a batch's and a fan-out's totals,
the report, the ablation, the benchmarks and the suite. Callers ask by name; the SQL lives here.
"""

from __future__ import annotations

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
