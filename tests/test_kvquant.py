"""KVQuant: quantization as one value from the CLI to the store; run hashes of stored configurations unchanged."""

import json
from pathlib import Path

import duckdb
import pytest

from nestedkv import compat
from nestedkv.press import NestedKVPress
from nestedkv.quant import KVQuant
from pipeline.config import RunConfig, parse_kv_bits
from pipeline.store import Store

# Configurations and their hashes as the code before KVQuant computed them (stores written then must resume).
STORED = json.loads((Path(__file__).parent / "stored_configs.json").read_text())


@pytest.mark.parametrize("row", STORED, ids=[json.dumps(r["fields"], sort_keys=True) for r in STORED])
def test_stored_configurations_keep_their_hashes(row):
    cfg = RunConfig(**row["fields"])
    assert cfg.canonical_json() == row["canonical_json"] and cfg.config_hash() == row["config_hash"]


def test_every_spelling_of_unquantized_is_one_value():
    assert {parse_kv_bits(t) for t in ("16", "none", " None ")} == {None}
    assert parse_kv_bits("4") == 4
    with pytest.raises(ValueError, match="--kv-bits must be 4 or 8"):
        parse_kv_bits("3")
    assert KVQuant(None, 32, False) == KVQuant()  # unquantized: one configuration, not one per group size
    with pytest.raises(ValueError, match="kv_group_size must be one of"):
        KVQuant(4, 48)


def test_press_config_and_row_carry_the_same_value():
    q = KVQuant(4, 32, False)
    cfg = RunConfig(press="nestedkv", **q.as_fields())
    assert cfg.kv_quant == q == cfg.make_press().kv_quant == KVQuant.from_fields(q.as_fields())
    assert NestedKVPress(kv_bits=8).kv_quant == KVQuant(8)
    assert (q.label(), KVQuant(8).label(), KVQuant().label()) == (" 4-bit g32 plain", " 8-bit", "")
    assert cfg.label().endswith("kv4/g32/plain")


@pytest.mark.parametrize("quant,left_out", [(KVQuant(), {"kv_bits", "kv_group_size", "kv_hadamard"}),
                                            (KVQuant(4, 32, False), {"kv_hadamard"}), (KVQuant(8), set())])
def test_a_stored_press_leaves_out_what_did_not_exist_yet_and_reads_back_the_same(quant, left_out):
    press = NestedKVPress(unrotate=False, **quant.as_fields())
    stored = json.loads(press.to_json())
    assert {"unrotate", *quant.as_fields()} - set(stored) == {"unrotate"} | left_out
    assert NestedKVPress.from_json(press.to_json()) == press
    assert compat.left_out(RunConfig(**quant.as_fields()).model_dump()) == left_out


def test_store_columns_hold_the_rotation_and_old_stores_get_them_from_config_json(tmp_path):
    db = str(tmp_path / "s.duckdb")
    configs = [RunConfig(task="qa"), RunConfig(task="qa", kv_bits=4), RunConfig(task="qa", kv_bits=4,
                                                                                kv_group_size=32, kv_hadamard=False)]
    with Store(db) as store:
        ids = [store.start_run(c, "in.parquet") for c in configs]
    want = [(None, 64, True), (4, 64, True), (4, 32, False)]

    def read():
        con = duckdb.connect(db, read_only=True)
        try:
            got = dict(((r, (b, g, h)) for r, b, g, h in
                        con.execute("SELECT run_id, kv_bits, kv_group_size, kv_hadamard FROM runs").fetchall()))
        finally:
            con.close()
        return [got[i] for i in ids]

    assert read() == want
    con = duckdb.connect(db)  # a store from before the columns existed
    con.execute("ALTER TABLE runs DROP COLUMN kv_group_size")
    con.execute("ALTER TABLE runs DROP COLUMN kv_hadamard")
    con.close()
    with Store(db, read_only=True) as store:  # read-only: not migrated, the queries derive the columns
        assert store.query(store._with_kv("SELECT {kv} FROM runs r ORDER BY r.created_at")).to_pylist() == \
            [dict(zip(("kv_bits", "kv_group_size", "kv_hadamard"), w)) for w in want]
    with Store(db):
        pass  # a writable open migrates
    assert read() == want
