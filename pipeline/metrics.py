"""The names of the evaluation metrics, as stored in ``evaluations.metric``: one definition for the code that
computes them (``pipeline.evaluate``) and the store's queries and views, which read them."""

CORRECT, AGREE_EXACT, ROUGE_L, DELTA_NLL, TOP1 = "correct", "agree_exact", "rouge_l", "delta_nll", "top1_agreement"
GOLD_KEPT, GOLD_NLL, DELTA_GOLD_NLL = "gold_kept", "gold_nll", "delta_gold_nll"
METRICS = (CORRECT, AGREE_EXACT, ROUGE_L, DELTA_NLL, TOP1, GOLD_NLL, DELTA_GOLD_NLL)
GOLD_METRICS = (CORRECT, GOLD_KEPT, GOLD_NLL)  # scored against gold: reference_run_id is NULL
REFERENCE_METRICS = (AGREE_EXACT, ROUGE_L, DELTA_NLL, TOP1, DELTA_GOLD_NLL)  # scored against the no_press run
# Summaries of documents with planted events (``pipeline.tasks.summary_documents``): the share they name, over
# all events, those in the middle 30-70% and those outside it. Scored against the plant: reference_run_id NULL.
COVERAGE, COVERAGE_MIDDLE, COVERAGE_ENDS = "coverage", "coverage_middle", "coverage_ends"
# The same summaries against the document's own words: each tenth of the text has words found in no other tenth,
# and a tenth counts as covered when the summary uses one of them (``evaluate.source_coverage``).
SOURCE, SOURCE_MIDDLE, SOURCE_ENDS = "source_coverage", "source_middle", "source_ends"
SOURCE_METRICS = (SOURCE, SOURCE_MIDDLE, SOURCE_ENDS)  # any summary, scored against its document: reference NULL
COVERAGE_METRICS = (COVERAGE, COVERAGE_MIDDLE, COVERAGE_ENDS, *SOURCE_METRICS)
UNREFERENCED = (*GOLD_METRICS, *SOURCE_METRICS)  # what evaluation_rows stores with reference_run_id NULL
MIDDLE = (0.3, 0.7)  # a document's middle, as shares of its text before a point (coverage, middle cuts)
HOOKED_METRICS = (GOLD_KEPT,)  # computed only when a run asks (--metrics): pipeline.evaluate.METRIC_HOOKS
