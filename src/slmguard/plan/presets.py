"""Presets: plan for a model before downloading it.

Owns the published architecture numbers of a few small instruct models and
the sizes of their common GGUF quantizations, and turns a preset into the
same :class:`~slmguard.plan.modelfacts.ModelFacts` a real header gives, so the
budget code has one input type.

Sources (read 2025; numbers copied by hand):
* architecture: each model's ``config.json`` on Hugging Face
  (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
  ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
  ``vocab_size``, ``max_position_embeddings``, ``sliding_window``);
* file sizes: the file tables of the GGUF repositories named per preset
  (``bartowski/<model>-GGUF`` unless noted), as shown there (two or three
  significant digits, decimal GB/MB). Gemma 3 270M Q4_K_M is the exact size of
  the file slmguard embeds.

The tensor table is synthesized from the architecture with llama.cpp's
Q4_K_M mix (``llama_tensor_get_type`` in src/llama-quant.cpp: attn_v and
ffn_down get Q6_K in about half the layers, the output/tied embedding Q6_K,
the rest Q4_K; K-quants need rows that are a multiple of 256, otherwise
Q5_0/Q8_0) and then scaled so the file adds up to the published size. It only
feeds the repacking estimate; the mapped size is the published one.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from slmguard.errors import UsageError
from slmguard.plan.modelfacts import SWA_PATTERNS, ModelFacts, TensorFacts
from slmguard.plan.text import shown

MB = 1_000_000

# ggml block sizes: type -> (elements per block, bytes per block); gguf.constants
_BLOCKS: Mapping[str, tuple[int, int]] = {
    "F32": (1, 4),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
    "Q5_0": (32, 22),
    "Q8_0": (32, 34),
}
_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class Preset:
    name: str
    title: str
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    tied_embeddings: bool
    file_bytes: Mapping[str, int]  # quant -> published file size
    source: str
    sliding_window: int = 0


PRESETS: Mapping[str, Preset] = {
    p.name: p
    for p in (
        # Qwen/Qwen2.5-0.5B-Instruct config.json; sizes: bartowski/Qwen2.5-0.5B-Instruct-GGUF
        Preset(
            "qwen2.5-0.5b-instruct", "Qwen2.5 0.5B Instruct", "qwen2",
            24, 896, 14, 2, 64, 4864, 151_936, 32_768, True,
            {"Q4_K_M": 398 * MB, "Q8_0": 531 * MB},
            "Qwen/Qwen2.5-0.5B-Instruct; bartowski/Qwen2.5-0.5B-Instruct-GGUF",
        ),
        # Qwen/Qwen2.5-1.5B-Instruct config.json; sizes: bartowski/Qwen2.5-1.5B-Instruct-GGUF
        Preset(
            "qwen2.5-1.5b-instruct", "Qwen2.5 1.5B Instruct", "qwen2",
            28, 1536, 12, 2, 128, 8960, 151_936, 32_768, True,
            {"Q4_K_M": 986 * MB, "Q8_0": 1650 * MB},
            "Qwen/Qwen2.5-1.5B-Instruct; bartowski/Qwen2.5-1.5B-Instruct-GGUF",
        ),
        # Qwen/Qwen2.5-3B-Instruct config.json; sizes: bartowski/Qwen2.5-3B-Instruct-GGUF
        Preset(
            "qwen2.5-3b-instruct", "Qwen2.5 3B Instruct", "qwen2",
            36, 2048, 16, 2, 128, 11008, 151_936, 32_768, True,
            {"Q4_K_M": 1930 * MB, "Q8_0": 3290 * MB},
            "Qwen/Qwen2.5-3B-Instruct; bartowski/Qwen2.5-3B-Instruct-GGUF",
        ),
        # meta-llama/Llama-3.2-1B-Instruct config.json; sizes: bartowski/Llama-3.2-1B-Instruct-GGUF
        Preset(
            "llama-3.2-1b-instruct", "Llama 3.2 1B Instruct", "llama",
            16, 2048, 32, 8, 64, 8192, 128_256, 131_072, True,
            {"Q4_K_M": 808 * MB, "Q8_0": 1320 * MB},
            "meta-llama/Llama-3.2-1B-Instruct; bartowski/Llama-3.2-1B-Instruct-GGUF",
        ),
        # meta-llama/Llama-3.2-3B-Instruct config.json; sizes: bartowski/Llama-3.2-3B-Instruct-GGUF
        Preset(
            "llama-3.2-3b-instruct", "Llama 3.2 3B Instruct", "llama",
            28, 3072, 24, 8, 128, 8192, 128_256, 131_072, True,
            {"Q4_K_M": 2020 * MB, "Q8_0": 3420 * MB},
            "meta-llama/Llama-3.2-3B-Instruct; bartowski/Llama-3.2-3B-Instruct-GGUF",
        ),
        # google/gemma-3-270m-it config.json; Q4_K_M: the embedded file (exact);
        # Q8_0: unsloth/gemma-3-270m-it-GGUF
        Preset(
            "gemma-3-270m-it", "Gemma 3 270M IT", "gemma3",
            18, 640, 4, 1, 256, 2048, 262_144, 32_768, True,
            {"Q4_K_M": 253_113_024, "Q8_0": 292 * MB},
            "google/gemma-3-270m-it; embedded file; unsloth/gemma-3-270m-it-GGUF",
            sliding_window=512,
        ),
        # google/gemma-3-1b-it config.json; sizes: bartowski/google_gemma-3-1b-it-GGUF
        Preset(
            "gemma-3-1b-it", "Gemma 3 1B IT", "gemma3",
            26, 1152, 4, 1, 256, 6912, 262_144, 32_768, True,
            {"Q4_K_M": 806 * MB, "Q8_0": 1070 * MB},
            "google/gemma-3-1b-it; bartowski/google_gemma-3-1b-it-GGUF",
            sliding_window=512,
        ),
        # microsoft/Phi-3.5-mini-instruct config.json; sizes: bartowski/Phi-3.5-mini-instruct-GGUF
        Preset(
            "phi-3.5-mini-instruct", "Phi-3.5 mini Instruct", "phi3",
            32, 3072, 32, 32, 96, 8192, 32_064, 131_072, False,
            {"Q4_K_M": 2390 * MB, "Q8_0": 4060 * MB},
            "microsoft/Phi-3.5-mini-instruct; bartowski/Phi-3.5-mini-instruct-GGUF",
        ),
    )
}  # fmt: skip


def preset_names() -> tuple[str, ...]:
    """``name`` and ``name:QUANT`` spellings accepted by ``--preset``."""
    out: list[str] = []
    for p in PRESETS.values():
        out.append(p.name)
        out.extend(f"{p.name}:{q}" for q in p.file_bytes)
    return tuple(out)


def parse_preset(spec: str) -> tuple[Preset, str]:
    """``qwen2.5-3b-instruct`` or ``qwen2.5-3b-instruct:Q8_0`` -> (preset, quant)."""
    name, _, quant = spec.partition(":")
    preset = PRESETS.get(name.lower())
    if preset is None:
        raise UsageError(
            f"unknown preset {shown(name)}", hint="choose one of: " + ", ".join(PRESETS)
        )
    quant = (quant or "Q4_K_M").upper()
    if quant not in preset.file_bytes:
        raise UsageError(
            f"preset {preset.name} has no "
            f"{quant if re.fullmatch(r'[A-Z0-9_]{1,16}', quant) else shown(quant)} size",
            hint="quantizations: " + ", ".join(preset.file_bytes),
        )
    return preset, quant


def _type_for(quant: str, base: str, row: int) -> str:
    t = "Q8_0" if quant == "Q8_0" else base
    if t in _FALLBACK and row % 256:
        t = _FALLBACK[t]
    return t


def _tensor(name: str, t: str, shape: tuple[int, ...]) -> TensorFacts:
    n = 1
    for d in shape:
        n *= d
    block, size = _BLOCKS[t]
    return TensorFacts(name, t, shape, 0, n // block * size)


def _synth_tensors(p: Preset, quant: str) -> list[TensorFacts]:
    q_dim, kv_dim = p.n_head * p.head_dim, p.n_head_kv * p.head_dim
    out = [
        _tensor(
            "token_embd.weight",
            _type_for(quant, "Q6_K" if p.tied_embeddings else "Q4_K", p.n_embd),
            (p.n_embd, p.n_vocab),
        )
    ]
    if not p.tied_embeddings:
        out.append(
            _tensor("output.weight", _type_for(quant, "Q6_K", p.n_embd), (p.n_embd, p.n_vocab))
        )
    out.append(_tensor("output_norm.weight", "F32", (p.n_embd,)))
    for il in range(p.n_layer):
        # Q4_K_M gives attn_v / ffn_down more bits in the first and last eighth
        # of the layers and every third layer between (use_more_bits).
        more = il < p.n_layer // 8 or il >= 7 * p.n_layer // 8 or (il - p.n_layer // 8) % 3 == 2
        big = "Q6_K" if more else "Q4_K"
        b = f"blk.{il}."
        out += [
            _tensor(b + "attn_norm.weight", "F32", (p.n_embd,)),
            _tensor(b + "ffn_norm.weight", "F32", (p.n_embd,)),
            _tensor(b + "attn_q.weight", _type_for(quant, "Q4_K", p.n_embd), (p.n_embd, q_dim)),
            _tensor(b + "attn_k.weight", _type_for(quant, "Q4_K", p.n_embd), (p.n_embd, kv_dim)),
            _tensor(b + "attn_v.weight", _type_for(quant, big, p.n_embd), (p.n_embd, kv_dim)),
            _tensor(b + "attn_output.weight", _type_for(quant, "Q4_K", q_dim), (q_dim, p.n_embd)),
            _tensor(b + "ffn_gate.weight", _type_for(quant, "Q4_K", p.n_embd), (p.n_embd, p.n_ff)),
            _tensor(b + "ffn_up.weight", _type_for(quant, "Q4_K", p.n_embd), (p.n_embd, p.n_ff)),
            _tensor(b + "ffn_down.weight", _type_for(quant, big, p.n_ff), (p.n_ff, p.n_embd)),
        ]
        if p.arch == "qwen2":  # Qwen2 carries Q/K/V biases (the budget counts tensors)
            out += [
                _tensor(b + "attn_q.bias", "F32", (q_dim,)),
                _tensor(b + "attn_k.bias", "F32", (kv_dim,)),
                _tensor(b + "attn_v.bias", "F32", (kv_dim,)),
            ]
    return out  # fmt: skip


def preset_facts(spec: str) -> tuple[ModelFacts, Preset, str]:
    """The :class:`ModelFacts` a preset's GGUF header would give (see module docstring)."""
    p, quant = parse_preset(spec)
    file_bytes = p.file_bytes[quant]
    header = 25 * p.n_vocab  # vocabulary strings dominate: 6.5 MB for 262,144 tokens
    tensors = _synth_tensors(p, quant)
    raw = sum(t.n_bytes for t in tensors)
    scale = (file_bytes - header) / raw
    scaled = tuple(
        TensorFacts(t.name, t.type_name, t.shape, 0, round(t.n_bytes * scale)) for t in tensors
    )
    by_type: dict[str, int] = {}
    for t in scaled:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    pattern = SWA_PATTERNS.get(p.arch) if p.sliding_window else None
    swa = tuple(il for il in range(p.n_layer) if pattern and il % pattern < pattern - 1)
    facts = ModelFacts(
        path=Path(f"{p.name}-{quant.lower()}.gguf"),
        arch=p.arch,
        name=p.title,
        n_layer=p.n_layer,
        n_head=p.n_head,
        n_head_kv=p.n_head_kv,
        key_length=p.head_dim,
        value_length=p.head_dim,
        n_embd=p.n_embd,
        n_vocab=p.n_vocab,
        n_ctx_train=p.n_ctx_train,
        sliding_window=p.sliding_window if swa else 0,
        swa_layers=swa,
        chat_template=None,
        file_bytes=file_bytes,
        tensor_bytes_by_type=dict(sorted(by_type.items())),
        n_ff=p.n_ff,
        data_offset_bytes=file_bytes - sum(by_type.values()),
        tensors=scaled,
    )
    return facts, p, quant
