"""Engine settings given over a plan's: what the engine flags of ``plan`` and ``serve`` say.

Owns :class:`EngineOverrides`: the context per slot (``--ctx``; :class:`EngineSettings`
has the engine's ``-c``, all slots together) and any :class:`EngineSettings` field by its
name, each taken from that field's own declaration (its flag, help and old spellings:
:func:`slmguard.options.group`). :meth:`EngineOverrides.over` puts them over a base
(a plan's engine settings), the one way serve's flags reach the engine; ``plan`` gives the
planner the fields it chooses (:data:`slmguard.plan.configs.FIXABLE`). No validation of
ranges here: the plan file's rules, the planner and serve's settings say what is valid.
Also :class:`ProjectorOverrides`: a vision projector (``--mmproj FILE``) and the image
bounds given, each bound :class:`ProjectorSpec`'s own declaration, checked against its rule.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from slmguard import options
from slmguard.errors import UsageError
from slmguard.plan.schema import EngineSettings, ProjectorSpec


@dataclass(frozen=True)
class EngineOverrides:
    """The engine settings given: ``ctx`` tokens per slot, ``fields`` by name.

    Example::

        EngineOverrides(ctx=4096, fields={"n_parallel": 2}).over(plan.engine)
        # plan.engine with n_parallel 2 and n_ctx 8192
    """

    ctx: int | None = field(
        default=None,
        metadata=options.metadata(
            "context per slot in tokens (the engine pads it to 256 cells); honoured or "
            "refused with the numbers",
            verbs=("plan", "serve"), shown_default="planned", metavar="TOKENS",
        ),
    )  # fmt: skip
    fields: Mapping[str, Any] = options.group(EngineSettings)

    def over(self, base: EngineSettings) -> EngineSettings:
        """``base`` with the given fields, and ``n_ctx`` = ``ctx`` x the slots when a
        context per slot is given (as ``plan --ctx`` writes it)."""
        engine = dataclasses.replace(base, **self.fields)
        if self.ctx is None:
            return engine
        return dataclasses.replace(engine, n_ctx=self.ctx * engine.n_parallel)

    def get(self, name: str) -> Any:
        """The value given for EngineSettings field ``name`` (None: not given)."""
        return self.fields.get(name)


def flag(name: str) -> str:
    """The flag of :class:`EngineSettings` field ``name``, as declared (``n_gpu_layers``:
    ``--gpu-layers``): what messages name."""
    declared = {f.name: f for f in dataclasses.fields(EngineSettings)}[name]
    return declared.metadata.get("flag") or options.default_flag(name)


#: The image bounds a plan's projector section holds (ProjectorSpec's fields with a flag).
IMAGE_BOUNDS = ("max_images", "max_image_bytes", "max_image_side", "max_image_pixels")


@dataclass(frozen=True)
class ProjectorOverrides:
    """A projector and the image bounds given: ``mmproj`` the file, ``bounds`` the
    :class:`ProjectorSpec` fields of :data:`IMAGE_BOUNDS` by name.

    Example::

        ProjectorOverrides(mmproj=Path("mmproj.gguf"), bounds={"max_images": 1})
    """

    mmproj: Path | None = field(
        default=None,
        metadata=options.metadata(
            "a vision projector GGUF (mmproj) for the model: its weights, image encoder, "
            "image tokens and requests' images planned, and served with it (images in chat, "
            "Responses and Messages requests)",
            verbs=("plan", "serve"), metavar="FILE",
        ),
    )  # fmt: skip
    bounds: Mapping[str, Any] = options.group(ProjectorSpec)

    def check(self, *, alone: bool = False) -> None:
        """UsageError (64) naming the flag of a bound outside its rule's range, or given
        without ``--mmproj`` (``alone``: allowed, for a plan's projector)."""
        declared = {f.name: f for f in dataclasses.fields(ProjectorSpec)}
        for name, value in self.bounds.items():
            r = declared[name].metadata["rule"]
            if not r.lo <= value <= r.hi:
                raise UsageError(
                    f"{projector_flag(name)} {value}: must be {r.lo:,.0f} to {r.hi:,.0f}"
                )
        if self.bounds and self.mmproj is None and not alone:
            raise UsageError(f"{projector_flag(next(iter(self.bounds)))} without --mmproj")

    def over(self, spec: ProjectorSpec) -> ProjectorSpec:
        """``spec`` with the bounds given."""
        return dataclasses.replace(spec, **self.bounds)


def projector_flag(name: str) -> str:
    """The flag of :class:`ProjectorSpec` field ``name`` (``--max-images``)."""
    declared = {f.name: f for f in dataclasses.fields(ProjectorSpec)}[name]
    return declared.metadata.get("flag") or options.default_flag(name)
