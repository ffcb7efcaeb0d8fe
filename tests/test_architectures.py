"""The architecture matrix: every mlx-lm model type that builds tiny from one config, with what NestedKV does
on it (docs/architectures.md has the table). Full-attention layers are compressed; sliding-window and
state layers keep mlx-lm's own caches and are counted in the accounting."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import CacheList, KVCache, load_prompt_cache, make_prompt_cache, save_prompt_cache

from nestedkv import NestedKVCache, NestedKVPress, clone, compress, layer_stats, make_cache, rewind, stack
from archs import make_arch_model

N, CHUNK, DECODE = 200, 64, 4
# model type -> the kinds of its two layers
F = "full,full"
MATRIX = {
    "llama": F, "qwen2": F, "qwen3": F, "phi3": F, "olmo2": F, "internlm3": F,
    "gemma": F, "gemma2": F, "smollm3": F, "starcoder2": F, "cohere": F,
    "deepseek": F, "deepseek_v3": F, "Klear": F, "gear": F,
    "gemma3_text": "sliding,full", "gpt_oss": "sliding,full", "olmo3": "sliding,full",
    "cohere2": "sliding,full",
    "qwen3_next": "state,full", "lfm2": "state,full",
}
TOKENS = mx.array([(i * 37 + 11) % 256 for i in range(N)])
_models = {}


def model_of(kind):
    if kind not in _models:
        _models[kind] = make_arch_model(kind)
    return _models[kind]


def prefill(model, cache):
    for i in range(0, N, CHUNK):
        logits = model(TOKENS[None, i : i + CHUNK], cache=cache)
    return logits


def decode(model, cache, logits, n=DECODE):
    out = []
    for _ in range(n):
        t = mx.argmax(logits[:, -1], axis=-1)
        out.append(int(t.item()))
        logits = model(t[None], cache=cache)
    return out


def compressed(kind, ratio):
    model = model_of(kind)
    cache = make_cache(model, NestedKVPress(compression_ratio=ratio))
    logits = prefill(model, cache)
    compress(cache)
    return model, cache, logits


@pytest.mark.parametrize("kind", sorted(MATRIX))
def test_matrix(kind):
    model = model_of(kind)
    ref_cache = make_prompt_cache(model)
    ref = decode(model, ref_cache, prefill(model, ref_cache))
    _, cache, logits = compressed(kind, 0.0)
    assert decode(model, cache, logits) == ref  # r = 0: mlx-lm's own prompt cache, token for token

    model, cache, logits = compressed(kind, 0.75)
    stats = layer_stats(cache)
    assert ",".join(s.kind for s in stats) == MATRIX[kind]
    for s, c in zip(stats, cache):
        assert s.bytes_resident == c.nbytes  # every layer counted, as its arrays hold it
        if s.kind == "full":
            assert isinstance(c, NestedKVCache) and s.kept_max == N // 4 and s.bytes_kept < s.bytes_full
            assert s.bytes_resident == s.bytes_kept  # compressed and not yet decoding: nothing but kept rows
        else:
            assert type(c) is type(ref_cache[s.layer]) and s.bytes_kept == s.bytes_full > 0
        if s.kind == "sliding":
            # mlx-lm's rotating cache: the window (32), plus the rest of the last chunk after a long one
            assert 32 <= s.kept_max < 32 + CHUNK and s.tokens_seen == N
    assert len(decode(model, cache, logits)) == DECODE


def test_hybrid_save_load_and_clone_decode_as_the_original(tmp_path):
    model, cache, logits = compressed("gemma3_text", 0.75)
    copy = clone(cache)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    want = decode(model, cache, logits)
    assert decode(model, copy, logits) == want  # the clone's rotating layer was not written by the original
    assert decode(model, loaded, logits) == want
    assert [type(c).__name__ for c in loaded] == ["RotatingKVCache", "NestedKVCache"]


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3_next"])
def test_hybrid_rewind_answers_the_next_question_from_the_same_context(kind):
    model, cache, logits = compressed(kind, 0.75)
    fresh = clone(cache)
    question = mx.array([(i * 13 + 5) % 256 for i in range(40)])[None]  # past the 32-row window
    model(question, cache=cache)
    rewind(cache)
    assert decode(model, cache, logits) == decode(model, fresh, logits)


def test_hybrid_adaptive_budget_and_kv_bits_compress_the_full_layers():
    quant = NestedKVPress(compression_ratio=0.75, kv_bits=8, kv_group_size=32)
    for kind, press in (("gpt_oss", NestedKVPress(compression_ratio=0.75, head_budget="adaptive")),
                        ("gemma3_text", quant)):
        model = make_arch_model(kind, head_dim=32)  # quantized groups of 32 need heads of 32 at least
        cache = make_cache(model, press)
        logits = prefill(model, cache)
        compress(cache)
        full = [s for s in layer_stats(cache) if s.kind == "full"]
        assert full and all(s.bytes_kept < s.bytes_full for s in full)
        assert len(decode(model, cache, logits)) == DECODE


def test_hybrid_unrotated_scoring_uses_each_layers_rope():
    model = model_of("gemma3_text")  # local layers rope base 10000 by default, global ones rope_theta
    cache = make_cache(model, NestedKVPress(compression_ratio=0.75, unrotate=True))
    full = [c for c in cache if isinstance(c, NestedKVCache)]
    layer = next(i for i, c in enumerate(cache) if isinstance(c, NestedKVCache))
    assert full[0].rope_spec["base"] == model.layers[layer].self_attn.rope.base


def test_hybrid_refusals_are_one_line():
    with pytest.raises(ValueError, match="attention sinks, which mlx's quantized attention does not support"):
        make_cache(make_arch_model("gpt_oss", head_dim=32), NestedKVPress(compression_ratio=0.75, kv_bits=8,
                                                                          kv_group_size=32))
    _, cache, _ = compressed("gemma3_text", 0.75)
    with pytest.raises(ValueError, match="layer 0 of this hybrid model is a RotatingKVCache"):
        stack([cache, cache])
    streaming = NestedKVPress(budget=64, prefill="streaming")
    with pytest.raises(ValueError, match="sliding-window and state layers of this hybrid model"):
        make_cache(model_of("gemma3_text"), streaming, positions=1024)


class _Model:
    def __init__(self, caches):
        self.layers, self._caches = [None] * len(caches), caches

    def make_cache(self):
        return list(self._caches)


def test_unsupported_layer_caches_are_refused_in_one_line():
    # a cache type of a model's own (deepseek_v41's compressing LayerCache), and mlx-lm's quantized cache
    from mlx_lm.models.cache import QuantizedKVCache

    with pytest.raises(ValueError, match=r": layer 1 uses QuantizedKVCache; NestedKV supports models whose layers use"):
        make_cache(_Model([KVCache(), QuantizedKVCache()]))


def test_a_model_without_full_attention_is_refused():
    from mlx_lm.models.cache import ArraysCache

    with pytest.raises(ValueError, match="no full-attention"):
        make_cache(_Model([ArraysCache(2), ArraysCache(2)]))


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3_next"])
def test_hybrid_documents_run_through_the_runner_with_every_layer_counted(kind):
    from pipeline.config import RunConfig
    from pipeline.documents import Document
    from pipeline.runner import Runner
    from tiny import ByteTokenizer, sample_docs

    cfg = RunConfig(task="qa", model="tiny", max_new_tokens=6, compression_ratio=0.75, head_budget="uniform")
    res = Runner(model_of(kind), ByteTokenizer(), cfg).run(Document(**sample_docs(1)[0]))
    assert res.status == "ok" and all(q.status == "ok" and q.n_generated for q in res.questions)
    kinds = {m.kind: m for m in res.layers}
    assert set(kinds) == set(MATRIX[kind].split(","))
    other = kinds["sliding" if "sliding" in kinds else "state"]
    assert other.bytes_kept == other.bytes_full > 0 and kinds["full"].bytes_kept < kinds["full"].bytes_full


@pytest.mark.parametrize("kind", ["gemma3_text", "qwen3_next"])
def test_hybrid_batch_decode_streaming_and_prefill_cache_answer_as_one_at_a_time(kind, tmp_path, prefills):
    """On a hybrid model the engine's batched decode (which cannot stack sliding or state layers) answers one
    document at a time, as without it; the prefill cache stores and loads the mixed layers; streaming prefill
    compresses the full layers while reading."""
    from pipeline.config import EngineOptions, RunConfig
    from pipeline.documents import Document
    from pipeline.engine import compute
    from pipeline.runner import Runner
    from tiny import ByteTokenizer, sample_docs

    base = dict(task="qa", model=f"test/tiny-{kind}", max_new_tokens=5, head_budget="uniform")  # a repo id: keyed by name
    configs = [RunConfig(**base, compression_ratio=r) for r in (0.5, 0.75)]
    runner = Runner(model_of(kind), ByteTokenizer(), configs[0])
    doc = Document(**sample_docs(1)[0])

    def answers(**options):
        got = compute(runner, doc, configs, options=EngineOptions(**options))
        assert all(o.result.status == "ok" for o in got), [o.result.error for o in got]
        return [[q.output for q in o.result.questions] for o in got]

    alone = answers()
    assert answers(batch_decode=True) == alone
    cached = str(tmp_path / "pc")
    assert answers(prefill_cache=cached) == alone  # computed and stored
    assert list((tmp_path / "pc").glob("*.safetensors"))
    prefills.clear()
    assert answers(prefill_cache=cached) == alone and prefills == []  # loaded, not prefilled again
    res = Runner(model_of(kind), ByteTokenizer(), RunConfig(**base, compression_ratio=0.75, prefill="streaming")).run(doc)
    assert res.status == "ok" and all(q.n_generated for q in res.questions), res.error
    full = [m for m in res.layers if m.kind == "full"]
    assert full and all(m.bytes_kept < m.bytes_full for m in full)


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_5", "mistral3"])
def test_a_wrapper_model_reads_its_text_models_window(kind):
    """Gemma 3 4B and up, Qwen3.5 and Mistral 3 keep their language model's settings in ``text_config``:
    the window comes from there (it came back None, and documents past it were read as if none existed)."""
    from pipeline.models.shape import model_info

    model = make_arch_model(kind)
    text = model.language_model.args
    assert model_info(model)["max_position_embeddings"] == text.max_position_embeddings is not None
