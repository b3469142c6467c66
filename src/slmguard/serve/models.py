"""The served models of one server: a table of engines, keyed by every name a model has.

Owns :class:`ModelTable`: the :class:`~slmguard.serve.modelengine.ModelEngine` of each
served model (the primary, the plan's ``model``, first), found by the ``model`` a
request names, its id or one of its aliases (:meth:`ModelTable.get`: 404
``model_not_found`` naming what is served), and their order for the governor and
eviction (:meth:`ModelTable.by_priority`: the lowest priority first, of equals the
later model first). A name shared by two models is refused (78) when the table is
made. Plain data over the engines: it starts, loads and evicts nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from slmguard.errors import ConfigError, NotFoundError

if TYPE_CHECKING:
    from slmguard.serve.modelengine import ModelEngine


class ModelTable:
    """Every served model's engine (see the module docstring); the first is the primary."""

    def __init__(self, engines: Sequence[ModelEngine]) -> None:
        if not engines:
            raise ValueError("a server serves at least one model")
        self._engines = tuple(engines)
        self._by_name: dict[str, ModelEngine] = {}
        for engine in self._engines:
            for name in engine.model.names:
                other = self._by_name.setdefault(name, engine)
                if other is not engine:
                    raise ConfigError(
                        f"the model name {name!r} is given to two models "
                        f"({other.model.path} and {engine.model.path})",
                        hint="give each model its own name and aliases",
                    )

    @property
    def primary(self) -> ModelEngine:
        return self._engines[0]

    @property
    def several(self) -> bool:
        """Whether this server serves more than one model (a board)."""
        return len(self._engines) > 1

    def __iter__(self) -> Iterator[ModelEngine]:
        return iter(self._engines)

    def __len__(self) -> int:
        return len(self._engines)

    def names(self) -> tuple[str, ...]:
        """Every name a client may send, model by model (ids, then aliases)."""
        return tuple(self._by_name)

    def find(self, name: object) -> ModelEngine | None:
        return self._by_name.get(name) if isinstance(name, str) else None

    def get(self, name: str) -> ModelEngine:
        """The engine of the model ``name`` names; 404 ``model_not_found`` otherwise."""
        engine = self.find(name)
        if engine is None:
            served = ", ".join(repr(n) for n in self._by_name)
            raise NotFoundError(
                f"model {name!r} is not served here; this server serves {served}",
                code="model_not_found",
                param="model",
            )
        return engine

    def by_priority(self) -> list[ModelEngine]:
        """Lowest priority first; of equal priority, the later model first (the primary
        last): the order the governor's ladder and eviction take."""
        order = range(len(self._engines))
        ranked = sorted(order, key=lambda i: (self._engines[i].residency.priority, -i))
        return [self._engines[i] for i in ranked]
