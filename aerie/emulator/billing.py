"""Money as OpenRouter and a provider handle it: what a generation costs, the final limits (credits, key limit),
the transient in-flight budget, and charging.

A provider bills a generation that started when it ends, whether or not the client is still there; the
ledger therefore holds an admitted request's cost as pending until it is charged or released, so that usage
never passes the credits even with many requests in flight.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from aerie.emulator.envelope import Refusal
from aerie.emulator.settings import EmulatorSettings, FakeProvider


@dataclass(frozen=True)
class Price:
    """What one request costs at its provider's prices (USD), and what it reserves while in flight."""

    prompt_cost: float
    completion_cost: float
    reserve: float  # input + max_tokens at the provider's prices: the in-flight budget's worst case

    @property
    def cost(self) -> float:
        return self.prompt_cost + self.completion_cost


def price(provider: FakeProvider, prompt_tokens: int, completion_tokens: int, max_tokens: int) -> Price:
    """The cost of a generation with these token counts at ``provider``'s prices."""
    return Price(
        prompt_tokens * provider.prompt_price,
        completion_tokens * provider.completion_price,
        prompt_tokens * provider.prompt_price + max_tokens * provider.completion_price,
    )


class Ledger:
    """The account: ``usage`` (USD charged so far) and what admitted, unfinished requests hold."""

    def __init__(self, settings: EmulatorSettings) -> None:
        self.settings = settings
        self.usage = 0.0  # USD charged so far
        self._pending_cost = 0.0  # cost of admitted, unfinished requests (keeps usage <= credits)
        self.reserved = 0.0  # in-flight budget reservations
        self._n_reserved = 0  # how many requests hold one (reset the float sums to 0 when none do)

    def refusal(self, p: Price) -> Refusal | None:
        """The 402 this request gets, if any: final limits first, then the transient in-flight reservation."""
        s = self.settings
        committed = self.usage + self._pending_cost + p.cost
        if s.credits is not None and committed > s.credits + 1e-12:
            return Refusal(
                "402-credits", 402, "Insufficient credits (emulated)", {"limit_source": "openrouter_credits"}
            )
        if s.key_limit is not None and committed > s.key_limit + 1e-12:
            return Refusal("402-key-limit", 402, "Key limit exceeded (emulated)", {"limit_source": "key_limit"})
        if s.in_flight_budget is not None and self.reserved + p.reserve > s.in_flight_budget + 1e-12:
            return Refusal(
                "402-in-flight",
                402,
                "In-flight budget exceeded: reserve input + max_tokens against the balance (emulated)",
                {"limit_source": "openrouter_in_flight_budget"},
                {"Retry-After": "1"},
            )
        return None

    @contextmanager
    def hold(self, p: Price, charged: bool) -> Iterator[None]:
        """Reserve ``p`` while the generation runs (its cost as pending when it will be ``charged``)."""
        pending = p.cost if charged else 0.0
        self.reserved += p.reserve
        self._n_reserved += 1
        self._pending_cost += pending
        try:
            yield
        finally:
            self._n_reserved -= 1
            self.reserved -= p.reserve
            self._pending_cost -= pending
            if not self._n_reserved:  # no float drift left behind
                self.reserved = self._pending_cost = 0.0

    def charge(self, cost: float) -> None:
        """Bill a finished (or abandoned but started) generation."""
        self.usage += cost
