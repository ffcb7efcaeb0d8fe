"""The project's own questions to a store, by name: what resume skips, a batch's and a fan-out's totals,
the report, the ablation, the benchmarks and the suite. Callers ask by name; the SQL lives here.
"""

from __future__ import annotations

from datetime import datetime
from typing import Iterable, Optional, Sequence

from pipeline.config import RunConfig
from pipeline.metrics import (AGREE_EXACT, CORRECT, COVERAGE_METRICS, DELTA_GOLD_NLL, DELTA_NLL, GOLD_NLL, ROUGE_L,
                              SOURCE, SOURCE_ENDS, SOURCE_MIDDLE, TOP1)
from pipeline.results import OK
from pipeline.store import lake
from pipeline.store.reads import Reads
from pipeline.compat import DERIVED

# Latest evaluation per (configuration, document, question, metric), then aggregated per configuration.
QUALITY_SQL = f"""
WITH ev AS (
    SELECT r.config_hash, r.model, r.press, r.head_budget, r.compression_ratio, r.budget, {{kv}},
           NOT {{kv_hadamard}} AS kv_plain,  -- quantized keys stored unrotated
           e.doc_id, e.question_idx, e.metric, e.value
    FROM evaluations e JOIN runs r ON r.run_id = e.run_id
    QUALIFY row_number() OVER (PARTITION BY r.config_hash, e.doc_id, e.question_idx, e.metric
                               ORDER BY r.created_at DESC, r.run_id DESC) = 1
)
SELECT config_hash, any_value(model) AS model, any_value(press) AS press, any_value(head_budget) AS head_budget,
       any_value(compression_ratio) AS compression_ratio, any_value(budget) AS budget, any_value(kv_bits) AS kv_bits,
       any_value(kv_group_size) AS kv_group_size, any_value(kv_hadamard) AS kv_hadamard,
       any_value(kv_plain) AS kv_plain, count(DISTINCT doc_id) AS n_docs,
       count(*) FILTER (WHERE metric = '{CORRECT}') AS n_questions,
       avg(value) FILTER (WHERE metric = '{CORRECT}') AS accuracy,
       avg(value) FILTER (WHERE metric = '{AGREE_EXACT}') AS agree_exact,
       avg(value) FILTER (WHERE metric = '{ROUGE_L}') AS rouge_l,
       avg(value) FILTER (WHERE metric = '{DELTA_NLL}') AS delta_nll,
       avg(value) FILTER (WHERE metric = '{TOP1}') AS top1_agreement,
       avg(value) FILTER (WHERE metric = '{GOLD_NLL}') AS gold_nll,
       avg(value) FILTER (WHERE metric = '{DELTA_GOLD_NLL}') AS delta_gold_nll,
       avg(value) FILTER (WHERE metric = '{SOURCE}') AS source_coverage,
       avg(value) FILTER (WHERE metric = '{SOURCE_MIDDLE}') AS source_middle,
       avg(value) FILTER (WHERE metric = '{SOURCE_ENDS}') AS source_ends
FROM ev GROUP BY config_hash
"""

# Context KV bytes kept, latest run per (configuration, document), over the configurations evaluated.
KEPT_SQL = """
WITH docs AS (
    SELECT r.config_hash, m.doc_id, m.content_sha256, m.run_id,
           sum(m.bytes_kept) AS kept_bytes, sum(m.bytes_full) AS full_bytes, sum(m.bytes_resident) AS resident_bytes
    FROM layer_memory m JOIN runs r ON r.run_id = m.run_id
    WHERE r.run_id IN (SELECT DISTINCT run_id FROM evaluations)
    GROUP BY r.config_hash, m.doc_id, m.content_sha256, m.run_id, r.created_at
    QUALIFY row_number() OVER (PARTITION BY r.config_hash, m.doc_id, m.content_sha256
                               ORDER BY r.created_at DESC, m.run_id DESC) = 1
)
SELECT config_hash, sum(kept_bytes) / nullif(sum(full_bytes), 0) AS kept_share,
       sum(resident_bytes) / nullif(sum(full_bytes), 0) AS resident_share,
       avg(resident_bytes) / 1048576.0 AS resident_mib
FROM docs GROUP BY config_hash
"""

SUITE_SCORES_SQL = """
SELECT r.config_hash, r.press, r.compression_ratio, r.head_budget, r.prefill, {kv}, s.task, s.length, s.kind,
       e.doc_id, e.question_idx, e.value
FROM evaluations e JOIN runs r ON r.run_id = e.run_id
JOIN outputs o ON o.run_id = e.run_id AND o.doc_id = e.doc_id AND o.question_idx = e.question_idx
JOIN suite_questions s ON s.doc_id = o.doc_id AND s.content_sha256 = o.content_sha256
    AND s.question_idx = o.question_idx
WHERE e.metric = $metric AND r.config_hash IN (SELECT unnest($hashes))
    AND o.content_sha256 IN (SELECT unnest($docs))
QUALIFY row_number() OVER (PARTITION BY r.config_hash, e.doc_id, e.question_idx
                           ORDER BY r.created_at DESC, r.run_id DESC) = 1
"""

KV_BYTES_SQL = """
SELECT r.config_hash, m.doc_id, sum(m.bytes_resident) AS resident, sum(m.bytes_full) AS full
FROM layer_memory m JOIN runs r ON r.run_id = m.run_id
WHERE r.config_hash IN (SELECT unnest($hashes)) AND m.content_sha256 IN (SELECT unnest($docs))
GROUP BY r.config_hash, m.run_id, m.doc_id, r.created_at
QUALIFY row_number() OVER (PARTITION BY r.config_hash, m.doc_id ORDER BY r.created_at DESC, m.run_id DESC) = 1
"""

# Seconds per document (each question's row repeats them), latest ok run per (configuration, document); the
# prefill's as computed, not the load time of a prefill cache entry (NULL: an entry that did not keep them).
COSTS_SQL = f"""
SELECT r.config_hash, o.doc_id, any_value(o.prefill_compute_s) AS prefill_s, any_value(o.compress_s) AS compress_s
FROM outputs o JOIN runs r ON r.run_id = o.run_id
WHERE r.config_hash IN (SELECT unnest($hashes)) AND o.content_sha256 IN (SELECT unnest($docs))
GROUP BY r.config_hash, o.run_id, o.doc_id, r.created_at HAVING bool_and(o.status = '{OK}')
QUALIFY row_number() OVER (PARTITION BY r.config_hash, o.doc_id ORDER BY r.created_at DESC, o.run_id DESC) = 1
"""

# A document answered under configuration $h: per run, every one of its output rows ok.
ANSWERED_SQL = f"""
SELECT o.run_id, o.doc_id, o.content_sha256, any_value(r.created_at) AS created_at
FROM outputs o JOIN runs r ON r.run_id = o.run_id
WHERE r.config_hash = $h
GROUP BY o.run_id, o.content_sha256, o.doc_id HAVING bool_and(o.status = '{OK}')
"""

SUMMARY_SQL = f"""
SELECT r.config_hash, r.press, r.compression_ratio, r.head_budget, r.prefill, {{kv}}, e.doc_id, e.metric,
       e.value
FROM evaluations e JOIN runs r ON r.run_id = e.run_id
JOIN (SELECT DISTINCT run_id, doc_id, content_sha256 FROM outputs) o ON o.run_id = e.run_id AND o.doc_id = e.doc_id
WHERE e.metric IN ('{ROUGE_L}', '{DELTA_NLL}', {", ".join(f"'{m}'" for m in COVERAGE_METRICS)})
    AND r.config_hash IN (SELECT unnest($hashes))
    AND o.content_sha256 IN (SELECT unnest($docs))
QUALIFY row_number() OVER (PARTITION BY r.config_hash, e.doc_id, e.metric ORDER BY r.created_at DESC, r.run_id DESC) = 1
"""


class Queries(Reads):
    # -- resume -----------------------------------------------------------------------------------
    def done_documents(self, config: RunConfig) -> set[tuple[str, str]]:
        """(doc_id, content_sha256) of documents answered ok (every question) under this exact configuration,
        in any run. Resume skips by this pair: the same text under a new doc_id still gets its own rows."""
        rows = self.query(f"SELECT DISTINCT doc_id, content_sha256 FROM ({ANSWERED_SQL})", {"h": config.config_hash()})
        return set(zip(rows.column("doc_id").to_pylist(), rows.column("content_sha256").to_pylist()))

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
        rows = self.query(f"SELECT content_sha256, arg_max(run_id, created_at) AS run_id FROM ({ANSWERED_SQL}) "
                          "GROUP BY content_sha256", {"h": config.config_hash()}).to_pylist()
        return {r["content_sha256"]: r["run_id"] for r in rows}

    def input_error_count(self, config: RunConfig, input: str) -> int:
        """Bad input rows recorded by runs of ``config`` over ``input``."""
        (n,) = self.query("SELECT count(*) FROM input_errors e JOIN runs r USING (run_id) WHERE r.config_hash "
                          "= $h AND r.input = $i", {"h": config.config_hash(), "i": str(input)}).column(0).to_pylist()
        return n

    # -- fan-out ----------------------------------------------------------------------------------
    def runs_of_input(self, input, since: datetime) -> list[dict]:
        """Status, host, pid and pid start of the runs over ``input`` started at ``since`` (UTC) or later."""
        return self.query("SELECT status, host, pid, pid_started_at FROM runs WHERE input = $i "
                          "AND created_at >= $since", {"i": str(input), "since": since}).to_pylist()

    def run_ids(self, config: RunConfig, inputs: Sequence[str]) -> list[str]:
        """The runs of ``config`` over any of ``inputs``, oldest first."""
        rows = self.query("SELECT run_id FROM runs WHERE config_hash = $h AND list_contains($inputs, input) "
                          "ORDER BY created_at", {"h": config.config_hash(), "inputs": list(inputs)}).to_pylist()
        return [r["run_id"] for r in rows]

    def document_outcomes(self, config: RunConfig, documents: Iterable[tuple[str, str]]) -> tuple[int, int]:
        """Of ``documents`` ((doc_id, content sha256) pairs): how many some run of ``config`` answered, and how
        many some run (any attempt, any earlier batch) answered all ok."""
        keys = [f"{doc_id}\0{sha}" for doc_id, sha in documents]
        stats = self.query(
            """
            SELECT count(*) AS n, count(*) FILTER (WHERE ok) AS ok FROM (
                SELECT doc_id, content_sha256, bool_or(run_ok) AS ok FROM (
                    SELECT o.doc_id, o.content_sha256, bool_and(o.status = 'ok') AS run_ok
                    FROM outputs o JOIN runs r ON r.run_id = o.run_id
                    WHERE r.config_hash = $h AND list_contains($keys, o.doc_id || chr(0) || o.content_sha256)
                    GROUP BY o.run_id, o.doc_id, o.content_sha256)
                GROUP BY doc_id, content_sha256)
            """, {"h": config.config_hash(), "keys": keys}).to_pylist()[0]
        return stats["n"] or 0, stats["ok"] or 0

    def data_path(self) -> Optional[str]:
        """Where a lake keeps its Parquet files (its catalog remembers); None for a DuckDB file."""
        if self.lake is None:
            return None
        with self._session():
            return self._read(lambda: lake.data_path_of(self.con))

    # -- savings ----------------------------------------------------------------------------------
    def memory_savings(self, run_ids: Sequence[str], columns: Sequence[str] = ("*",)) -> list[dict]:
        """``columns`` of the ``memory_savings`` view for these runs, by press and setting."""
        if not run_ids:
            return []
        return self.query(
            f"SELECT {', '.join(columns)} FROM memory_savings WHERE run_id IN (SELECT unnest(?)) "
            "ORDER BY press, compression_ratio, head_budget, budget, prefill, kv_bits", [list(run_ids)]).to_pylist()

    def layer_savings(self, run_id: str, columns: Sequence[str] = ("*",)) -> list[dict]:
        """``columns`` of the ``layer_savings`` view for one run, by layer."""
        return self.query(f"SELECT {', '.join(columns)} FROM layer_savings WHERE run_id = ? ORDER BY layer",
                          [run_id]).to_pylist()

    # -- reports ----------------------------------------------------------------------------------
    def quality_by_config(self) -> list[dict]:
        """Answer quality per evaluated configuration (``QUALITY_SQL``), unordered."""
        return self.query(self._with_kv(QUALITY_SQL)).to_pylist()

    def _with_kv(self, sql: str) -> str:
        """``sql`` with ``{kv}`` (the quantization columns) and ``{kv_hadamard}`` filled in. A read-only open
        does not migrate a store: one written before a column existed reads it from config_json (or NULL
        bits: before quantized KV)."""
        have = set(self.query("SELECT * FROM runs LIMIT 0").column_names)
        bits = "r.kv_bits" if "kv_bits" in have else "NULL"
        cols = {n: f"r.{n}" if n in have else DERIVED[n].format(r="r.").replace("r.kv_bits", bits) for n in DERIVED}
        kv = ", ".join([f"{bits} AS kv_bits"] + [f"{e} AS {n}" for n, e in cols.items()])
        return sql.replace("{kv}", kv).replace("{kv_hadamard}", cols["kv_hadamard"])

    def kept_by_config(self) -> list[dict]:
        """KV kept and resident shares, and resident MiB per document, per evaluated configuration
        (``KEPT_SQL``)."""
        return self.query(KEPT_SQL).to_pylist()

    def evaluations_by_config(self) -> list[dict]:
        """Every evaluation value with its run's configuration hash."""
        return self.query("SELECT r.config_hash, e.doc_id, e.question_idx, e.metric, e.value FROM evaluations e "
                          "JOIN runs r USING (run_id)").to_pylist()

    def answers_at_ratio(self, ratio: float) -> list[dict]:
        """(doc_id, question_idx, output) of the runs at this compression ratio, ordered."""
        return self.query("SELECT o.doc_id, o.question_idx, o.output FROM outputs o JOIN runs r USING (run_id) "
                          "WHERE r.compression_ratio = ? ORDER BY ALL", [ratio]).to_pylist()

    # -- the suite (its questions: ``Store.write_suite_questions``) ----------------------------------------
    def unscored_suite_answers(self) -> list[dict]:
        """Ok answers to suite questions without a ``recall`` row yet, with the question's parts."""
        return self.query("""
            SELECT o.run_id, o.doc_id, o.question_idx, o.output, s.parts
            FROM outputs o JOIN suite_questions s ON s.doc_id = o.doc_id AND s.content_sha256 = o.content_sha256
                AND s.question_idx = o.question_idx
            WHERE o.status = 'ok' AND NOT EXISTS (
                SELECT 1 FROM evaluations e WHERE e.run_id = o.run_id AND e.doc_id = o.doc_id
                    AND e.question_idx = o.question_idx AND e.metric = 'recall')
        """).to_pylist()

    def unscored_outputs(self, docs: Sequence[str], metric: str) -> list[dict]:
        """Ok outputs for these document content hashes without a ``metric`` row yet."""
        return self.query("""
            SELECT o.run_id, o.doc_id, o.question_idx, o.content_sha256, o.output FROM outputs o
            WHERE o.status = 'ok' AND o.content_sha256 IN (SELECT unnest($docs)) AND NOT EXISTS (
                SELECT 1 FROM evaluations e WHERE e.run_id = o.run_id AND e.doc_id = o.doc_id
                    AND e.question_idx = o.question_idx AND e.metric = $metric)
        """, {"docs": list(docs), "metric": metric}).to_pylist()

    def suite_scores(self, hashes: Sequence[str], docs: Sequence[str], metric: str) -> list[dict]:
        """The latest run's ``metric`` per (configuration, document, question), with the question's task and
        length, for these configuration hashes and document content hashes."""
        return self.query(self._with_kv(SUITE_SCORES_SQL), {"hashes": list(hashes), "docs": list(docs), "metric": metric}).to_pylist()

    def kv_bytes_by_document(self, hashes: Sequence[str], docs: Sequence[str]) -> list[dict]:
        """Resident and full KV bytes per (configuration, document), latest run, for these configuration
        hashes and document content hashes."""
        return self.query(KV_BYTES_SQL, {"hashes": list(hashes), "docs": list(docs)}).to_pylist()

    def costs_by_document(self, hashes: Sequence[str], docs: Sequence[str]) -> list[dict]:
        """Prefill and compression seconds per (configuration, document), latest ok run, for these
        configuration hashes and document content hashes."""
        return self.query(COSTS_SQL, {"hashes": list(hashes), "docs": list(docs)}).to_pylist()

    def summary_agreement(self, hashes: Sequence[str], docs: Sequence[str]) -> list[dict]:
        """ROUGE-L and delta-NLL of each summary against the uncompressed one, latest run per (configuration,
        document), for these configuration hashes and document content hashes."""
        return self.query(self._with_kv(SUMMARY_SQL), {"hashes": list(hashes), "docs": list(docs)}).to_pylist()
