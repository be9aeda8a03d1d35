"""``no_grad``: no watched parameter has a gradient (every ``.grad`` is None) for ``patience``
steps in a row: ``loss.backward()`` was not called, or the loss is not connected to these
parameters (the optimizer's parameters are not the model's, a detached loss). Known on the host
without a sync. Gradients that exist but are exactly zero are ``vanishing_grad``, not this."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..record import StepRecord
from .base import Context, Finding, Rule


@dataclass(frozen=True)
class NoGradConfig:
    patience: int = 2
    """Steps in a row: a loop that skips backward on one batch on purpose (an empty batch)
    but still calls step is not a fault; a forgotten backward misses it at every step."""


class NoGrad(Rule[NoGradConfig]):
    name = "no_grad"
    kinds = ("no_grad",)
    Config = NoGradConfig
    STATE = ("missing", "fired")
    OPTIONS: ClassVar[dict[str, str]] = {}

    def __init__(self, config: NoGradConfig | None = None, ctx: Context | None = None) -> None:
        super().__init__(config, ctx)
        self.missing = 0
        self.fired = False

    def observe(self, s: StepRecord) -> list[Finding]:
        if s.host.grads_present != 0:
            self.missing, self.fired = 0, False
            return []
        self.missing += 1
        if self.missing < self.config.patience or self.fired:
            return []
        self.fired = True
        return [Finding(
            "no_grad",
            "no gradients at all: no parameter has a .grad (was loss.backward() called? are "
            f"the parameters the optimizer's?), for {self.missing} steps in a row, none of the "
            f"{len(self.ctx.names)} watched parameters. Check first: the backward call, then "
            "a loss detached from the model (.detach(), .item(), torch.no_grad())",
            {"steps": self.missing, "parameters": len(self.ctx.names)})]
