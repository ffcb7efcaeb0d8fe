"""The store's views: what a user asks in SQL (memory saved per run and layer, quality against the
uncompressed twin, peak KV bytes), replaced on every writable open so view changes reach old stores."""

# The byte sums both savings views report, per run or per run and layer.
_RUN_KEY = "r.run_id, r.press, r.prefill, r.compression_ratio, r.head_budget, r.budget, r.kv_bits"
_SAVED_COLUMNS = """
       sum(m.bytes_full)::BIGINT AS bytes_full,
       sum(m.bytes_kept)::BIGINT AS bytes_kept,
       sum(m.bytes_resident)::BIGINT AS bytes_resident,
       sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS kept_share,
       1 - sum(m.bytes_kept) / nullif(sum(m.bytes_full), 0) AS saved_share,
       sum(m.bytes_resident) / nullif(sum(m.bytes_full), 0) AS resident_share,
       (sum(m.bytes_full) - sum(m.bytes_kept)) / 1048576.0 AS saved_mib"""
_SAVED_BYTES = _SAVED_COLUMNS + """
FROM runs r JOIN layer_memory m ON m.run_id = r.run_id"""

MEMORY_SAVINGS_SQL = f"""
CREATE OR REPLACE VIEW memory_savings AS
WITH plans AS (  -- how the memory plan read each run's documents, and their peaks (outputs: one row a question)
    SELECT run_id,
           string_agg(DISTINCT regexp_replace(memory_plan, ' of [0-9]+$', ''), ', ' ORDER BY
                      regexp_replace(memory_plan, ' of [0-9]+$', '')) AS memory_plans,
           max(planned_peak_bytes) / 1048576.0 AS planned_peak_mib,
           max(peak_prefill_bytes) / 1048576.0 AS peak_mib
    FROM outputs GROUP BY run_id
)
SELECT {_RUN_KEY},
       count(DISTINCT (m.content_sha256, m.doc_id)) AS n_documents,{_SAVED_COLUMNS},
       any_value(p.memory_plans) AS memory_plans, any_value(p.planned_peak_mib) AS planned_peak_mib,
       any_value(p.peak_mib) AS peak_mib
FROM runs r JOIN layer_memory m ON m.run_id = r.run_id LEFT JOIN plans p ON p.run_id = r.run_id
GROUP BY {_RUN_KEY}
"""

LAYER_SAVINGS_SQL = f"""
CREATE OR REPLACE VIEW layer_savings AS
SELECT {_RUN_KEY}, m.layer,
       min(coalesce(m.kind, 'full')) AS kind,
       count(*) AS n_documents,
       avg(m.tokens_seen) AS tokens_seen,
       avg(m.kept_min) AS kept_min,
       avg(m.kept_max) AS kept_max,
       avg(m.kept_mean) AS kept_mean,{_SAVED_BYTES}
GROUP BY {_RUN_KEY}, m.layer
"""

# Two kinds of evaluation rows: agreement with a twin's output (reference_run_id names the twin; the
# twin's own value would be trivially perfect) and scores against gold (reference_run_id NULL; then the
# twin's score on the same document and question is put beside it as full_value).
QUALITY_VS_FULL_SQL = """
CREATE OR REPLACE VIEW quality_vs_full AS
WITH twins AS (
    SELECT r.run_id, f.run_id AS twin_id
    FROM runs r JOIN runs f ON f.config_hash = r.reference_config_hash AND f.press = 'no_press'
    WHERE r.config_hash <> r.reference_config_hash
),
pairs AS (
    SELECT t.run_id, t.twin_id AS reference_run_id, e.metric, e.value, CAST(NULL AS DOUBLE) AS full_value
    FROM twins t JOIN evaluations e ON e.run_id = t.run_id AND e.reference_run_id = t.twin_id
    UNION ALL
    SELECT t.run_id, t.twin_id, e.metric, e.value, fe.value
    FROM twins t
    JOIN evaluations e ON e.run_id = t.run_id AND e.reference_run_id IS NULL
    JOIN evaluations fe ON fe.run_id = t.twin_id AND fe.reference_run_id IS NULL AND fe.metric = e.metric
        AND fe.doc_id = e.doc_id AND fe.question_idx IS NOT DISTINCT FROM e.question_idx
)
SELECT r.run_id, p.reference_run_id, r.press, r.compression_ratio, r.head_budget, r.budget, r.kv_bits, p.metric,
       avg(p.value) AS mean_value,
       avg(p.full_value) AS full_value,
       avg(p.value - p.full_value) AS delta,
       count(*) AS n,
       ms.kept_share,
       ms.resident_share
FROM pairs p
JOIN runs r ON r.run_id = p.run_id
LEFT JOIN memory_savings ms ON ms.run_id = p.run_id
GROUP BY r.run_id, p.reference_run_id, r.press, r.compression_ratio, r.head_budget, r.budget, r.kv_bits, p.metric,
         ms.kept_share, ms.resident_share
"""

# Peak KV bytes per document come from outputs (one value per document, repeated on its question rows) or,
# where those are not filled, from the sum of its layer_memory peaks; documents without either are left out.
# 0 means not measured (the results' default): a document that held tokens never peaks at 0 bytes.
PEAK_SAVINGS_SQL = """
CREATE OR REPLACE VIEW peak_savings AS
WITH docs AS (
    SELECT run_id, doc_id, content_sha256,
           max(peak_kv_prefill_bytes) AS prefill_peak, max(peak_kv_decode_bytes) AS decode_peak
    FROM outputs GROUP BY run_id, doc_id, content_sha256
),
layers AS (
    SELECT run_id, doc_id, content_sha256, sum(bytes_full) AS bytes_full,
           sum(peak_prefill_kv_bytes) AS prefill_peak, sum(peak_decode_kv_bytes) AS decode_peak
    FROM layer_memory GROUP BY run_id, doc_id, content_sha256
),
per_doc AS (
    SELECT l.run_id, l.bytes_full,
           coalesce(nullif(d.prefill_peak, 0), nullif(l.prefill_peak, 0)) AS prefill_peak,
           coalesce(nullif(d.decode_peak, 0), nullif(l.decode_peak, 0)) AS decode_peak
    FROM layers l LEFT JOIN docs d USING (run_id, doc_id, content_sha256)
)
SELECT r.run_id, r.press, r.prefill, r.compression_ratio, r.head_budget, r.budget, r.kv_bits,
       count(*) AS n_documents,
       sum(p.bytes_full)::BIGINT AS bytes_full,
       sum(p.prefill_peak)::BIGINT AS peak_prefill_kv_bytes,
       sum(p.decode_peak)::BIGINT AS peak_decode_kv_bytes,
       sum(p.prefill_peak) / nullif(sum(p.bytes_full) FILTER (WHERE p.prefill_peak IS NOT NULL), 0)
           AS prefill_peak_share,
       sum(p.decode_peak) / nullif(sum(p.bytes_full) FILTER (WHERE p.decode_peak IS NOT NULL), 0)
           AS decode_peak_share,
       (sum(p.bytes_full) FILTER (WHERE p.prefill_peak IS NOT NULL) - sum(p.prefill_peak)) / 1048576.0
           AS prefill_saved_mib,
       (sum(p.bytes_full) FILTER (WHERE p.decode_peak IS NOT NULL) - sum(p.decode_peak)) / 1048576.0
           AS decode_saved_mib
FROM runs r JOIN per_doc p ON p.run_id = r.run_id
WHERE p.prefill_peak IS NOT NULL OR p.decode_peak IS NOT NULL
GROUP BY r.run_id, r.press, r.prefill, r.compression_ratio, r.head_budget, r.budget, r.kv_bits
"""

VIEWS = {"memory_savings": MEMORY_SAVINGS_SQL, "layer_savings": LAYER_SAVINGS_SQL,
         "quality_vs_full": QUALITY_VS_FULL_SQL, "peak_savings": PEAK_SAVINGS_SQL}
