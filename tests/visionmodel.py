"""A tiny Gemma 3 vision projector GGUF, written at test time: a real mmproj llama-server loads.

No vision model can be fetched here, so the tests make one: a SigLIP-style encoder of one
or two layers with Gemma 3's projector (average pool by ``n_merge``, RMS norm, a linear
map into the text model's width), small deterministic weights (numpy, seeded). Its image
embeddings mean nothing (the weights are random): what the model answers about an image
is meaningless by construction. But the engine runs it exactly as it runs the real
Gemma 3 4B projector (the same ``clip.cpp`` graph, image preprocessing, ``<start_of_image>``
markers and non-causal image decode), so the front, the plan and the memory figures are
tested against the real engine's vision path.

What the file holds, from llama.cpp's ``tools/mtmd`` as bundled with llama-cpp-python
0.3.36 (``clip-impl.h`` for the key and tensor names, ``clip.cpp``
``clip_model_loader::load_hparams``/``load_tensors`` for what is required,
``models/siglip.cpp`` for the graph):

- ``clip.projector_type = gemma3``, ``clip.has_vision_encoder = true``, ``clip.use_gelu``;
  ``clip.vision.embedding_length``, ``.feed_forward_length``, ``.block_count``,
  ``.projection_dim``, ``.attention.head_count``, ``.attention.layer_norm_epsilon``,
  ``.image_size``, ``.patch_size``, ``.image_mean``, ``.image_std`` (3 floats each) and
  ``clip.vision.projector.scale_factor`` (the pool's ``n_merge``, 4 by default).
- Tensors (ggml dims, fastest first; numpy shapes are the reverse): ``v.patch_embd``
  {patch, patch, 3, n_embd} with a bias, ``v.position_embd`` {n_embd, n_patches}; per
  layer ``v.blk.N.attn_q``/``_k``/``_v``/``_out`` {n_embd, n_embd} with biases, ``ln1``
  and ``ln2`` (weight and bias), ``ffn_up`` {n_embd, n_ff}, ``ffn_down`` {n_ff, n_embd}
  with biases (n_ff differs from n_embd, or the loader takes them for a swapped pair);
  ``v.post_ln``; ``mm.soft_emb_norm`` {n_embd}; ``mm.input_projection`` {n_embd_text,
  n_embd}: its first dimension is the width the text model must have (640 for the
  embedded Gemma 3 270M; the engine refuses a mismatch).

An image becomes ``(image_size / patch_size / n_merge) ** 2`` tokens whatever its size:
Gemma 3's projector resizes every image to ``image_size`` squared. F32 (or F16 matrices);
:func:`write_projector` writes it and the same seed writes the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The embedded Gemma 3 270M's width (``gemma3.embedding_length``).
TEXT_EMBD = 640


@dataclass(frozen=True)
class Projector:
    """The shape of one tiny projector. The default makes 16 tokens an image."""

    image_size: int = 224
    patch_size: int = 14
    n_merge: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_ff: int = 128
    n_layer: int = 1
    n_embd_text: int = TEXT_EMBD
    #: the matrices' type: "F32", or "F16" as llama.cpp's converter writes them
    #: (patch embedding, attention, FFN and projection; norms, biases and
    #: position embeddings stay F32)
    weight_type: str = "F32"

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_image(self) -> int:
        return (self.patches_per_side // self.n_merge) ** 2


def _weights(p: Projector, seed: int) -> dict[str, Any]:
    """Every tensor, numpy-shaped (ggml's dims reversed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n_patches = p.patches_per_side**2

    def normal(*shape: int, std: float = 0.05) -> Any:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def ones(n: int) -> Any:
        return np.ones(n, dtype=np.float32)

    def zeros(n: int) -> Any:
        return np.zeros(n, dtype=np.float32)

    t: dict[str, Any] = {
        "v.patch_embd.weight": normal(p.n_embd, 3, p.patch_size, p.patch_size, std=0.02),
        "v.patch_embd.bias": zeros(p.n_embd),
        "v.position_embd.weight": normal(n_patches, p.n_embd, std=0.02),
    }
    for i in range(p.n_layer):
        blk = f"v.blk.{i}"
        for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
            t[f"{blk}.{part}.weight"] = normal(p.n_embd, p.n_embd, std=0.1)
            t[f"{blk}.{part}.bias"] = zeros(p.n_embd)
        for norm in ("ln1", "ln2"):
            t[f"{blk}.{norm}.weight"] = ones(p.n_embd)
            t[f"{blk}.{norm}.bias"] = zeros(p.n_embd)
        t[f"{blk}.ffn_up.weight"] = normal(p.n_ff, p.n_embd, std=0.1)
        t[f"{blk}.ffn_up.bias"] = zeros(p.n_ff)
        t[f"{blk}.ffn_down.weight"] = normal(p.n_embd, p.n_ff, std=0.1)
        t[f"{blk}.ffn_down.bias"] = zeros(p.n_embd)
    t["v.post_ln.weight"] = ones(p.n_embd)
    t["v.post_ln.bias"] = zeros(p.n_embd)
    t["mm.soft_emb_norm.weight"] = ones(p.n_embd)
    t["mm.input_projection.weight"] = normal(p.n_embd, p.n_embd_text, std=0.05)
    if p.weight_type == "F16":
        for name, data in t.items():
            if name.endswith(".weight") and data.ndim >= 2 and "position" not in name:
                t[name] = data.astype(np.float16)
    elif p.weight_type != "F32":
        raise ValueError(f"weight_type {p.weight_type!r}: F32 or F16")
    return t


def write_projector(path: Path, projector: Projector | None = None, *, seed: int = 29) -> Path:
    """Write the projector GGUF to ``path`` (see the module docstring); returns ``path``."""
    import gguf

    p = projector or Projector()
    if p.n_ff == p.n_embd:
        raise ValueError("n_ff must differ from n_embd (the loader would swap ffn up/down)")
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_name("tiny-gemma3-projector")
    w.add_description("random weights written by tests/visionmodel.py: outputs mean nothing")
    w.add_file_type(1 if p.weight_type == "F16" else 0)  # mostly F16, or all F32
    w.add_string("clip.projector_type", "gemma3")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.embedding_length", p.n_embd)
    w.add_uint32("clip.vision.feed_forward_length", p.n_ff)
    w.add_uint32("clip.vision.block_count", p.n_layer)
    w.add_uint32("clip.vision.projection_dim", p.n_embd_text)
    w.add_uint32("clip.vision.attention.head_count", p.n_head)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", p.image_size)
    w.add_uint32("clip.vision.patch_size", p.patch_size)
    w.add_uint32("clip.vision.projector.scale_factor", p.n_merge)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    for tensor, data in _weights(p, seed).items():
        w.add_tensor(tensor, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":  # python tests/visionmodel.py OUT.gguf
    import sys

    print(write_projector(Path(sys.argv[1])))
