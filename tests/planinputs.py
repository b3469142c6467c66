"""Engine settings and budget inputs for the plan tests, with the defaults they share.

``engine(n_ctx=2048)`` is an :class:`EngineSettings` with n_batch = n_ubatch = 512 and
4 threads unless given; ``budget_input(facts, n_ctx=2048, flash_attn=True)`` the
:class:`BudgetInput` of such an engine on the x86-64 host (4 CPUs, no reserves) unless
``board`` or ``gpu`` says otherwise.
"""

from __future__ import annotations

from typing import Any

from slmguard.plan.modelfacts import ModelFacts
from slmguard.plan.parts import X86_HOST, BudgetInput
from slmguard.plan.schema import BudgetBoard, BudgetGpu, EngineSettings

DEFAULTS: dict[str, Any] = {"n_batch": 512, "n_ubatch": 512, "n_threads": 4}


def engine(**fields: Any) -> EngineSettings:
    return EngineSettings(**{**DEFAULTS, **fields})


def budget_input(
    facts: ModelFacts,
    *,
    board: BudgetBoard = X86_HOST,
    gpu: BudgetGpu | None = None,
    front_process: bool = True,
    fill_tokens: int | None = None,
    **fields: Any,
) -> BudgetInput:
    return BudgetInput(facts, engine(**fields), board, gpu, front_process, fill_tokens)


def board(n_cpus: int = 4, isa: str = "x86_avx2", **reserves: int) -> BudgetBoard:
    return BudgetBoard(isa=isa, n_cpus=n_cpus, **reserves)
