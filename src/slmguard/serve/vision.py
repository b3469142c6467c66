"""The projector one server serves: what a request's images may be, and what they cost.

Owns :class:`ServedVision`, made once at start from the plan's projector section
(:class:`~slmguard.plan.schema.ProjectorSpec`: the image bounds the budget holds) and the
projector's header facts, and :class:`Images`, one request's images as the dialects,
the sizing and the policy see them: their count, the tokens they take in the slot
(:func:`~slmguard.plan.projector.image_tokens`: the engine's around each, the text
split at each), and what they hold in
the engine while they are read, decoded and encoded
(:func:`~slmguard.plan.projector.request_bytes` on each image's own header: the governor's
projection). :meth:`ServedVision.check` holds a request's images to the bounds with
:mod:`slmguard.serve.images` before the engine sees anything; :func:`no_projector` is the
400 of a server without one. Pure: no I/O, no engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slmguard.errors import RequestError
from slmguard.plan.projector import (
    ProjectorFacts,
    data_url_chars,
    image_tokens,
    request_bytes,
)
from slmguard.plan.schema import ProjectorSpec
from slmguard.serve.images import ImageLimits, check_images


@dataclass(frozen=True)
class Images:
    """One request's images: how many, their tokens in the slot, their transient bytes."""

    count: int = 0
    tokens: int = 0
    transient_bytes: int = 0


NO_IMAGES = Images()


def no_projector(field: str) -> RequestError:
    """A request with an image to a server without a projector (400 naming the field)."""
    return RequestError(
        f"{field}: this server has no vision projector, so it takes no images (serve "
        "--mmproj FILE, or a plan made with --mmproj)",
        code="images_not_supported",
        param=field,
    )


@dataclass(frozen=True)
class ServedVision:
    """The served projector: the plan's section and the file's header facts."""

    spec: ProjectorSpec
    facts: ProjectorFacts

    @property
    def limits(self) -> ImageLimits:
        s = self.spec
        return ImageLimits(
            max_bytes=s.max_image_bytes,
            max_side=s.max_image_side,
            max_pixels=s.max_image_pixels,
            max_images=s.max_images,
        )

    @property
    def image_tokens(self) -> int:
        """One image's tokens in a slot at most (:func:`~slmguard.plan.projector.image_tokens`)."""
        return image_tokens(self.spec.tokens_per_image)

    @property
    def body_room_bytes(self) -> int:
        """What a request body may hold beyond ``--max-body-bytes``: the data URLs of the
        most images a request may carry, each of the largest size."""
        return self.spec.max_images * data_url_chars(self.spec.max_image_bytes)

    def check(self, found: Sequence[tuple[str, str]]) -> Images:
        """A request's images (``(field, url)`` each) held to the bounds: the count, the
        tokens and the transient bytes; a RequestError (400) naming the field otherwise."""
        if not found:
            return NO_IMAGES
        images = check_images(found, self.limits)
        chars = sum(len(url) for _, url in found)
        held = request_bytes(self.facts, images=0, data_url_chars=chars, decode_bytes=0) + sum(
            request_bytes(self.facts, images=1, data_url_chars=0, decode_bytes=i.decode_bytes)
            for i in images
        )
        return Images(len(images), len(images) * self.image_tokens, held)
