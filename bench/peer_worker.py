"""The kvpress side of ``bench.peer``; runs in the peer environment (torch, transformers, kvpress).

    <peer python> bench/peer_worker.py REQUEST.json RESPONSE.json

Started by file path, not as ``bench.peer_worker``: importing the package would load mlx, which the peer
environment does not have. Standard library, numpy, torch, transformers, kvpress and ``rss.py`` beside it only.

Requests (JSON): ``{"op": "probe", ...}`` writes the logits of ``probe_ids`` to ``probe_out`` (.npy);
``{"op": "bench", ...}`` runs every document under every configuration with kvpress's press context manager
(``with press(model): model.model(context)``, one forward pass, as kvpress prefills) and answers each
question greedily on top of the compressed cache, the question at positions after the original context,
then crops the cache back to the context, which is the protocol of kvpress's own pipeline;
``{"op": "kvzip_scores", ...}`` writes kvpress's KVzip scores of one context (``kvzip_scores``);
``{"op": "scorer_scores", ...}`` those of one of its scorer presses (``scorer_scores``).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

from rss import peak_rss  # beside this file: started by path, its folder leads sys.path

# The folder's other modules (long.py, memory.py, quant.py...) must not shadow what the packages below import.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import kvpress  # noqa: E402 (after the line above, as are the others)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM, pipeline  # noqa: E402
from transformers.utils import logging  # noqa: E402


def _versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "transformers", "kvpress"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def load(model_dir: str, threads: int):
    logging.disable_progress_bar()  # the caller reads our output only when we fail
    torch.set_num_threads(threads)
    # sdpa: AdaKV's masking needs an attention implementation other than eager.
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


def make_press(spec: dict):
    """A kvpress press from ``{"press": class name, "compression_ratio": r, "adaptive": bool, "kwargs": {}}``;
    None for no compression."""
    if spec["press"] is None:
        return None
    press = getattr(kvpress, spec["press"])(compression_ratio=spec["compression_ratio"], **spec.get("kwargs", {}))
    return kvpress.AdaKVPress(press) if spec.get("adaptive") else press


def probe(req: dict) -> dict:
    model, _ = load(req["model_dir"], req["threads"])
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([req["probe_ids"]])).logits[0].float().numpy()
    np.save(req["probe_out"], logits)
    return {"versions": _versions(), "shape": list(logits.shape)}


def kv_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def answer(model, tokenizer, cache, question_ids: list, context_len: int, max_new: int, eos: set) -> tuple[str, int]:
    """Greedy answer after the compressed context, stopping before an end token; (text, tokens generated)."""
    ids = torch.tensor([question_ids])
    pos = torch.arange(context_len, context_len + len(question_ids))[None]
    out = model(input_ids=ids, past_key_values=cache, position_ids=pos, logits_to_keep=1)
    tokens: list[int] = []
    nxt = int(out.logits[0, -1].argmax())
    at = context_len + len(question_ids)
    while nxt not in eos and len(tokens) < max_new:
        tokens.append(nxt)
        if len(tokens) == max_new:
            break
        out = model(input_ids=torch.tensor([[nxt]]), past_key_values=cache, position_ids=torch.tensor([[at]]))
        nxt = int(out.logits[0, -1].argmax())
        at += 1
    return tokenizer.decode(tokens, skip_special_tokens=True).strip(), len(tokens)


def prompt_check(model, tokenizer, context: str, questions: list, context_ids: list, questions_ids: list) -> bool:
    """Whether kvpress's own pipeline turns (context, questions) into exactly our token ids (importing kvpress
    registered its pipeline task)."""
    pipe = pipeline("kv-press-text-generation", model=model, tokenizer=tokenizer, device="cpu")
    got = pipe.preprocess(context, questions, answer_prefix="", max_context_length=10**9)
    return (got["context_ids"][0].tolist() == context_ids
            and [q[0].tolist() for q in got["questions_ids"]] == questions_ids)


def bench(req: dict) -> dict:
    t_load = time.perf_counter()
    model, tokenizer = load(req["model_dir"], req["threads"])
    load_s = time.perf_counter() - t_load
    eos, max_new = set(req["eos"]), req["max_new_tokens"]
    docs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for doc in req["documents"]:
            ctx = doc["context_ids"]
            same = None if doc.get("context_text") is None else prompt_check(
                model, tokenizer, doc["context_text"], doc["question_texts"], ctx, doc["questions_ids"])
            runs = []
            for spec in req["configs"]:
                press = make_press(spec)
                cache = DynamicCache()
                t = time.perf_counter()
                if press is None:
                    model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
                else:
                    with press(model):
                        model.model(input_ids=torch.tensor([ctx]), past_key_values=cache)
                prefill_s = time.perf_counter() - t
                resident = kv_bytes(cache)
                n_ctx = cache.get_seq_length()
                answers, generated, decode_s = [], [], []
                for q in doc["questions_ids"]:
                    t = time.perf_counter()
                    text, n = answer(model, tokenizer, cache, q, len(ctx), max_new, eos)
                    decode_s.append(time.perf_counter() - t)
                    cache.crop(n_ctx)
                    answers.append(text)
                    generated.append(n)
                runs.append({"label": spec["label"], "prefill_s": prefill_s, "decode_s": decode_s,
                             "n_generated": generated, "answers": answers, "kv_resident_bytes": resident})
            docs.append({"doc_id": doc["doc_id"], "n_tokens": len(ctx), "prompt_equal": same, "runs": runs})
    return {"versions": _versions(), "threads": torch.get_num_threads(), "load_s": load_s,
            "wall_s": time.perf_counter() - t0, "documents": docs, "peak_rss_bytes": peak_rss()}


def kvzip_scores(req: dict) -> dict:
    """kvpress's KVzip scores of ``context_ids`` (``[layers, kv heads, n]``, to ``scores_out``, .npy) with
    ``chunk_size``-token chunks from the first token (no chat prefix left unscored), before its sinks are
    raised; with the instruction ids it fed, so our side feeds the same."""
    model, _ = load(req["model_dir"], req["threads"])
    seen: dict = {}

    class Recording(kvpress.KVzipPress):
        def _perform_kvzip_compression(self, model, tokenizer):
            self.prefix_length = 0
            seen["suffix"] = self._suffix_ids[0].tolist()
            return super()._perform_kvzip_compression(model, tokenizer)

        def prepare(self, model, tokenizer, prev_postfix_size=8):
            pairs = super().prepare(model, tokenizer, prev_postfix_size)
            seen["feeds"] = [r[0].tolist() for _, r in pairs]
            return pairs

        def compress_post(self, model):
            seen["scores"] = self.score_val[:, 0].float().numpy().copy()
            return super().compress_post(model)

    press = Recording(compression_ratio=0.5, chunk_size=req["chunk_size"])
    with torch.inference_mode(), press(model):
        model.model(input_ids=torch.tensor([req["context_ids"]]), past_key_values=DynamicCache())
    np.save(req["scores_out"], seen["scores"])
    return {"versions": _versions(), "suffix": seen["suffix"], "feeds": seen["feeds"]}


def scorer_scores(req: dict) -> dict:
    """The scores ``[layers, kv heads, n]`` (to ``scores_out``, .npy) kvpress's scorer press ``press`` (class
    name, with ``kwargs``) gives ``context_ids`` in one prefill, as it returns them to its compression (its
    sinks padded in)."""
    model, _ = load(req["model_dir"], req["threads"])
    seen: dict = {}
    base = getattr(kvpress, req["press"])

    class Recording(base):
        def score(self, module, *args, **kwargs):
            scores = super().score(module, *args, **kwargs)
            seen[module.layer_idx] = scores[0].float().numpy().copy()
            return scores

    press = Recording(compression_ratio=0.5, **req.get("kwargs", {}))
    with torch.inference_mode(), press(model):
        model.model(input_ids=torch.tensor([req["context_ids"]]), past_key_values=DynamicCache())
    np.save(req["scores_out"], np.stack([seen[i] for i in sorted(seen)]))
    return {"versions": _versions()}


def main(argv: list) -> int:
    req = json.loads(open(argv[1]).read())
    out = {"probe": probe, "bench": bench, "kvzip_scores": kvzip_scores,
           "scorer_scores": scorer_scores}[req["op"]](req)
    with open(argv[2], "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
