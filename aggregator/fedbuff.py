"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022).

Asynchronous like FedAsync, but the server does not mix every upload into the model at once:
it buffers each client's delta (v - base, base the model the client started from), weighted
by a staleness function s(d) = (1 + d)^-e, and after `buffer_size` uploads applies their mean,
w := w + server_lr * (1/K) sum_i s(d_i) (v_i - base_i), then empties the buffer. A reply is
always the current global model (uploads in a partly filled buffer are not in it yet).
Staleness d counts uploads since the client's tau, capped per agent as for every async
strategy here (UploadLedger; `fedbuff.staleness_cap = 0` is the paper's plain count).
Knobs live in `[fedbuff]`; the buffer is part of the state, so journal replay is exact.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from aggregator.aggregation import polynomial_staleness, weighted_delta_mean
from aggregator.strategy import GlobalModelStrategy, Reply, Upload, check_vector
from fedmq.config import FedBuffSettings
from fedmq.models import ModelSpec


class FedBuff(GlobalModelStrategy):
    name = "fedbuff"

    def __init__(self, spec: ModelSpec, initial: Tensor, *, buffer_size: int = 10,
                 server_lr: float = 1.0, staleness_exponent: float = 0.5,
                 staleness_cap: int = 1) -> None:
        if buffer_size < 1:
            raise ValueError(f"fedbuff.buffer_size must be >= 1, got {buffer_size}")
        if not server_lr > 0:
            raise ValueError(f"fedbuff.server_lr must be > 0, got {server_lr}")
        if staleness_exponent < 0:
            raise ValueError(f"fedbuff.staleness_exponent must be >= 0, got {staleness_exponent}")
        super().__init__(spec, initial, staleness_cap)
        self.buffer_size = int(buffer_size)
        self.server_lr = float(server_lr)
        self.exponent = float(staleness_exponent)
        self.buffer = torch.zeros(spec.numel, dtype=torch.float64)
        """Sum of s(d_i) (v_i - base_i) over the uploads since the last flush."""
        self.buffered = 0
        self.version = 0
        """Flushes so far: the global model's version."""

    @classmethod
    def from_settings(cls, spec: ModelSpec, initial: Tensor, settings: FedBuffSettings) -> FedBuff:
        return cls(spec, initial, buffer_size=settings.buffer_size, server_lr=settings.server_lr,
                   staleness_exponent=settings.staleness_exponent,
                   staleness_cap=settings.staleness_cap)

    def _reply(self, agent: str, info: dict[str, Any]) -> Reply:
        return super()._reply(agent, {**info, "version": self.version})

    def apply(self, upload: Upload, alpha: list[float] | None = None, sent: Tensor | None = None) -> Reply:
        vector = check_vector(upload.vector, self.spec.numel, f"upload from {upload.agent}")
        if upload.base is not None:
            base = check_vector(upload.base, self.spec.numel, f"base of {upload.agent}")
        else:  # the service knows every base it replied with; without one, the model now
            base = self.model
            self.counters["no_base"] += 1
        self.uploads_applied += 1
        d = self.ledger.staleness(upload.tau, self.uploads_applied)
        self.ledger.record(upload.agent, self.uploads_applied)
        s = polynomial_staleness(d, self.exponent)
        self.buffer += s * (vector.double() - base.double())
        self.buffered += 1
        flushed = self.buffered >= self.buffer_size
        if flushed:
            self.model = weighted_delta_mean(self.model, [self.buffer], [1.0 / self.buffered],
                                             scale=self.server_lr, normalize=False)
            self.buffer.zero_()
            self.buffered = 0
            self.version += 1
            self.counters["flushes"] += 1
        self.counters["applied"] += 1
        return self._reply(upload.agent, {"staleness": d, "uploads_since": self.uploads_applied - int(upload.tau),
                                          "stale": False, "s": s, "flushed": flushed})

    def state_dict(self) -> dict[str, Any]:
        return {"algorithm": self.name, "spec": self.spec.hash, "epoch": self.uploads_applied,
                "model": self.model.clone(), "buffer": self.buffer.clone(), "buffered": self.buffered,
                "version": self.version, "counters": dict(self.counters),
                "ledger": self.ledger.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._check_state(d)
        self.model = check_vector(d["model"], self.spec.numel, "state model").clone()
        buffer = d["buffer"]
        if not isinstance(buffer, Tensor) or buffer.shape != (self.spec.numel,):
            raise ValueError(f"state buffer does not fit {self.spec.numel} parameters")
        self.buffer = buffer.to(torch.float64).clone()
        self.buffered = int(d["buffered"])
        self.version = int(d["version"])
        self.uploads_applied = int(d["epoch"])
        self.ledger.load_state_dict(d.get("ledger", {}))
        self.counters.clear()
        self.counters.update(d["counters"])
