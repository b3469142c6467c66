"""A tiny BERT reranker GGUF, written at test time: a real model llama-server reranks with.

No reranking model can be fetched here, so the tests make one: a two-layer BERT
cross-encoder with a classification head (pooling type rank), small deterministic
weights (numpy, seeded) and a WordPiece vocabulary of a few hundred words. Its scores
mean nothing (the weights are random), but the engine runs it exactly as it runs a real
BERT reranker (bge-reranker, ms-marco MiniLM): the same architecture, tokenizer, pooling
and head, so the front is tested against the real engine's rerank path.

What the file holds, from llama.cpp's loader as bundled with llama-cpp-python 0.3.36
(``src/llama-arch.cpp`` for the names, ``src/models/bert.cpp`` for the tensors and their
shapes, ``src/llama-model.cpp`` for the hyper-parameters, ``src/llama-vocab.cpp`` for the
WPM tokenizer, ``src/llama-graph.cpp`` ``build_pooling`` for the rank head):

- ``general.architecture = bert``; ``bert.context_length`` (the position embedding's
  rows), ``bert.embedding_length``, ``bert.block_count``, ``bert.feed_forward_length``,
  ``bert.attention.head_count``, ``bert.attention.layer_norm_epsilon`` (required by the
  BERT loader), ``bert.attention.causal = false`` (an encoder), ``bert.pooling_type = 4``
  (rank: the [CLS] row, then the head).
- ``tokenizer.ggml.model = bert`` (WPM); the token list with a word's first piece
  written ``"\\u2581word"`` and a continuation piece bare (the tokenizer prefixes each
  word with U+2581 and takes the longest known piece, left to right; a word it cannot
  cover is one [UNK]); token types (3, control, for the specials); the special ids;
  ``tokenizer.ggml.token_type_count = 2`` (the BERT loader refuses a model without
  token types). ``add_bos`` ([CLS]) and ``add_eos`` ([SEP], the eos id) make the engine's
  rerank prompt ``[CLS] query [SEP] document [SEP]``.
- Tensors (ggml dims, fastest first; numpy shapes are the reverse): ``token_embd``
  {n_embd, n_vocab}, ``token_types`` {n_embd, 2}, ``position_embd`` {n_embd, n_ctx},
  ``token_embd_norm`` weight and bias {n_embd}; per layer ``blk.N.attn_q``/``_k``/``_v``
  and ``attn_output`` {n_embd, n_embd} with biases, ``attn_output_norm``,
  ``ffn_up`` {n_embd, n_ff}, ``ffn_down`` {n_ff, n_embd} with biases,
  ``layer_output_norm``; the head ``cls`` {n_embd, n_embd} (then tanh) and
  ``cls.output`` {n_embd, 1} with biases: one score per (query, document) pair.

All F32, about 0.5 MB. :func:`write_reranker` writes it; the same seed writes the
same bytes. :func:`write_embedder` writes the same encoder as an embedding model (mean
pooling, ``bert.pooling_type = 1``, without the head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ARCH = "bert"
N_EMBD = 64
N_HEAD = 4
N_LAYER = 2
N_FF = 128
N_CTX_TRAIN = 512
RANK_POOLING = 4
MEAN_POOLING = 1
NAME = "tiny-bert-reranker"
EMBEDDER_NAME = "tiny-bert-embedder"

SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
PAD, UNK, CLS, SEP, MASK = range(len(SPECIALS))
_CONTROL, _NORMAL = 3, 1  # llama.cpp's token types
WORD_START = "\u2581"

_WORD_TEXT = """
the of and to in is was for on that with as by at from it be are this an or which his
her they their have has had not but all were when one there can been who more will if
no out so said what up its about into than them only other new some could time these
two may then do first any my now such like our over man me even most made after also
did many before must through back years where much your way well down should because
each just those people how too little state good very make world still own see men
work long get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three city
capital country river mountain sea lake island town village street house home school
university library museum book books paper letter word words language english french
german music song film art history science math physics chemistry biology medicine
doctor hospital health food water bread fruit apple banana orange coffee tea milk
cheese wine beer dinner lunch breakfast cook kitchen table chair bed door window
car bus train plane ship boat bike road bridge station airport travel trip map
dog cat bird fish horse cow sheep pig mouse lion tiger bear wolf fox rabbit
tree flower grass leaf forest garden park field farm sun moon star sky cloud rain
snow wind storm weather hot cold warm summer winter spring autumn morning night
computer software program code data file network server model memory disk machine
phone email web page search query answer question result document text test
red blue green yellow black white big small fast slow high low open close begin end
paris france london england berlin germany rome italy madrid spain tokyo japan
"""
#: Whole words of the vocabulary (each one token, with its word-start mark).
WORDS = tuple(_WORD_TEXT.split())

#: Letters and digits, each as a word start and as a continuation piece: every ASCII
#: word of letters and digits tokenizes without [UNK] (a word the list lacks is spelt).
PIECES = "abcdefghijklmnopqrstuvwxyz0123456789"
PUNCTUATION = ".,;:!?'\"()[]{}-_/\\@#$%&*+=<>|~`^"


def vocabulary() -> list[str]:
    """The token list: the specials, punctuation, words, then single-character pieces."""
    tokens = list(SPECIALS)
    tokens += [WORD_START + c for c in PUNCTUATION]
    tokens += [WORD_START + w for w in dict.fromkeys(WORDS)]
    tokens += [WORD_START + c for c in PIECES if WORD_START + c not in tokens]
    tokens += list(PIECES)
    return tokens


def _weights(n_vocab: int, seed: int) -> dict[str, Any]:
    """Every tensor, numpy-shaped (ggml's dims reversed)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.05) -> Any:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> Any:
        return np.zeros(n, dtype=np.float32)

    t: dict[str, Any] = {
        "token_embd.weight": normal(n_vocab, N_EMBD, std=0.5),
        "token_types.weight": normal(2, N_EMBD),
        "position_embd.weight": normal(N_CTX_TRAIN, N_EMBD, std=0.1),
        "token_embd_norm.weight": ones(N_EMBD),
        "token_embd_norm.bias": zeros(N_EMBD),
    }
    for i in range(N_LAYER):
        blk = f"blk.{i}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_output"):
            t[f"{blk}.{part}.weight"] = normal(N_EMBD, N_EMBD, std=0.2)
            t[f"{blk}.{part}.bias"] = normal(N_EMBD, std=0.02)
        t[f"{blk}.attn_output_norm.weight"] = ones(N_EMBD)
        t[f"{blk}.attn_output_norm.bias"] = zeros(N_EMBD)
        t[f"{blk}.ffn_up.weight"] = normal(N_FF, N_EMBD, std=0.2)
        t[f"{blk}.ffn_up.bias"] = normal(N_FF, std=0.02)
        t[f"{blk}.ffn_down.weight"] = normal(N_EMBD, N_FF, std=0.2)
        t[f"{blk}.ffn_down.bias"] = normal(N_EMBD, std=0.02)
        t[f"{blk}.layer_output_norm.weight"] = ones(N_EMBD)
        t[f"{blk}.layer_output_norm.bias"] = zeros(N_EMBD)
    t["cls.weight"] = normal(N_EMBD, N_EMBD, std=0.3)
    t["cls.bias"] = zeros(N_EMBD)
    t["cls.output.weight"] = normal(1, N_EMBD, std=1.0)
    t["cls.output.bias"] = zeros(1)
    return t


def write_reranker(path: Path, *, seed: int = 23, template: str | None = None) -> Path:
    """Write the reranker GGUF to ``path`` (see the module docstring); returns ``path``.
    ``template``: a rerank prompt template (``tokenizer.chat_template.rerank``, with
    ``{query}`` and ``{document}``), which the engine then renders and tokenizes with
    the special tokens in it parsed, instead of putting [CLS] and [SEP] around them."""
    return _write(path, NAME, RANK_POOLING, seed, template)


def write_embedder(path: Path, *, seed: int = 23) -> Path:
    """The same encoder as an embedding model: mean pooling, no classification head."""
    return _write(path, EMBEDDER_NAME, MEAN_POOLING, seed)


def _write(path: Path, name: str, pooling: int, seed: int, template: str | None = None) -> Path:
    import gguf

    tokens = vocabulary()
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_file_type(0)  # all F32
    w.add_uint32(f"{ARCH}.context_length", N_CTX_TRAIN)
    w.add_uint32(f"{ARCH}.embedding_length", N_EMBD)
    w.add_uint32(f"{ARCH}.block_count", N_LAYER)
    w.add_uint32(f"{ARCH}.feed_forward_length", N_FF)
    w.add_uint32(f"{ARCH}.attention.head_count", N_HEAD)
    w.add_float32(f"{ARCH}.attention.layer_norm_epsilon", 1e-12)
    w.add_bool(f"{ARCH}.attention.causal", False)
    w.add_uint32(f"{ARCH}.pooling_type", pooling)
    w.add_string("tokenizer.ggml.model", "bert")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.token_type",
                [_CONTROL if t in SPECIALS else _NORMAL for t in tokens])  # fmt: skip
    w.add_uint32("tokenizer.ggml.token_type_count", 2)
    for key, token in (("bos", CLS), ("eos", SEP), ("unknown", UNK), ("seperator", SEP),
                       ("padding", PAD), ("cls", CLS), ("mask", MASK)):  # fmt: skip
        w.add_uint32(f"tokenizer.ggml.{key}_token_id", token)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", True)
    w.add_bool("tokenizer.ggml.add_sep_token", False)
    w.add_bool("tokenizer.ggml.normalizer.lowercase", True)
    if template is not None:
        w.add_string("tokenizer.chat_template.rerank", template)
    for tensor, data in _weights(len(tokens), seed).items():
        if pooling == RANK_POOLING or not tensor.startswith("cls"):
            w.add_tensor(tensor, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":  # python tests/rerankmodel.py OUT.gguf
    import sys

    print(write_reranker(Path(sys.argv[1])))
