"""FedAsync: one global model, mixed with every upload by a staleness-discounted weight.

w := (1 - a_t) w + a_t v with a_t = fedasync.mixing * s(t - tau), s a hinge (`[fedasync]`).
There is no staleness cut-off (the hinge alone discounts old uploads); the reply is the
global model.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from aggregator.aggregation import hinge_staleness, mix
from aggregator.strategy import GlobalModelStrategy, Reply, Upload, check_vector
from fedmq.config import FedAsyncSettings
from fedmq.models import ModelSpec


class FedAsync(GlobalModelStrategy):
    name = "fedasync"

    def __init__(self, spec: ModelSpec, initial: Tensor, *, mixing: float = 0.6,
                 hinge_a: float = 10.0, hinge_b: float = 5.0, staleness_cap: int = 1) -> None:
        if not 0.0 <= mixing <= 1.0:
            raise ValueError(f"fedasync.mixing must be in [0, 1], got {mixing}")
        super().__init__(spec, initial, staleness_cap)
        self.mixing = float(mixing)
        self.hinge_a = float(hinge_a)
        self.hinge_b = float(hinge_b)
        self.last_reply_version: dict[str, int] = {}

    @classmethod
    def from_settings(cls, spec: ModelSpec, initial: Tensor, settings: FedAsyncSettings) -> FedAsync:
        return cls(spec, initial, mixing=settings.mixing, hinge_a=settings.hinge_a,
                   hinge_b=settings.hinge_b, staleness_cap=settings.staleness_cap)

    def _reply(self, agent: str, info: dict[str, Any]) -> Reply:
        self.last_reply_version[agent] = self.uploads_applied
        return super()._reply(agent, info)

    def apply(self, upload: Upload, alpha: list[float] | None = None, sent: Tensor | None = None) -> Reply:
        vector = check_vector(upload.vector, self.spec.numel, f"upload from {upload.agent}")
        self.uploads_applied += 1
        d = self.ledger.staleness(upload.tau, self.uploads_applied)
        self.ledger.record(upload.agent, self.uploads_applied)
        s = hinge_staleness(d, self.hinge_a, self.hinge_b)
        a_t = self.mixing * s
        mix(self.model, vector, a_t)
        self.counters["applied"] += 1
        return self._reply(upload.agent, {"staleness": d, "uploads_since": self.uploads_applied - int(upload.tau),
                                          "stale": False, "s": s, "mixing": a_t})

    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": self.name, "spec": self.spec.hash, "epoch": self.uploads_applied,
                "model": self.model.clone(), "last_epoch": dict(self.last_reply_version),
                "counters": dict(self.counters), "ledger": self.ledger.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._check_state(d)
        self.model = check_vector(d["model"], self.spec.numel, "state model").clone()
        self.uploads_applied = int(d["epoch"])
        self.last_reply_version = {str(a): int(e) for a, e in d["last_epoch"].items()}
        self.ledger.load_state_dict(d.get("ledger", {}))
        self.counters.clear()
        self.counters.update(d["counters"])
