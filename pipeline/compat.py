"""What keeps a store written by an earlier version resuming and readable, in one place: how a run's hash
leaves out settings added since (at the values every run had before them), and what the columns added since
hold in old rows. The press settings' own rule (``nestedkv.compat``) lives in the library, which needs it
without the pipeline; this module builds on it.
"""

from __future__ import annotations

from nestedkv import compat as press_compat

# A run setting added after runs were stored: left out of the hash while at its default, so those runs resume.
HASHED_WHEN_SET = {"hashed_when_set": True}


def hashed_settings(config) -> dict:
    """A ``RunConfig``'s fields as its hash covers them (its press parameters aside)."""
    fields = type(config).model_fields
    before = {**press_compat.BEFORE, **{n: f.default for n, f in fields.items()
                                        if (f.json_schema_extra or {}).get("hashed_when_set")}}
    dump = press_compat.stored(config.model_dump(exclude={"long_docs"}), before)
    # Runs stored before long_docs existed said truncate true/false: false refused what the default reads now,
    # and those documents were never done, so the default hashes as false did and loses nothing.
    dump["truncate"] = config.long_docs == "truncate"
    if config.long_docs not in ("truncate", fields["long_docs"].default):
        dump["long_docs"] = config.long_docs
    return dump


# Store columns added since that need a value in old rows: every layer stored before hybrid models was full
# attention; no press read the questions before question-aware presses.
COLUMN_DEFAULTS = {("layer_memory", "kind"): "'full'", ("runs", "saw_questions"): "false"}
# Columns added since whose old rows take another column's value: rows stored before the prefill cache kept
# its seconds counted a prefill as computed.
COPIED = {("outputs", "prefill_compute_s"): "prefill_s"}
# Columns added after runs were stored, as their values follow from a run's config_json (``{r}``: the runs
# table's alias): what a migration fills in, and what a read-only open of an unmigrated store reads. The hash
# leaves the settings out at their old values (nestedkv.compat), hence the defaults here.
DERIVED = {
    "kv_group_size": "coalesce(TRY_CAST(json_extract_string({r}config_json, '$.kv_group_size') AS INTEGER), 64)",
    "kv_hadamard": "({r}kv_bits IS NULL OR coalesce(json_extract_string({r}config_json, '$.kv_hadamard') = 'true', "
                   "false))",
}
