"""The server-side algorithm interface: tensors in, replies out, no MQTT.

One small interface in the spirit of Flower's strategies, one module per algorithm. The
service layer (aggregator/engine.py) validates envelopes, calls a strategy, journals what
it applied and encodes the replies; a strategy can therefore be tested, benchmarked and
simulated without a broker.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass
class Upload:
    """One agent's model update: the trained vector and the clock (`tau`) of the model it started from."""

    agent: str
    vector: Tensor
    tau: int
    n_samples: int = 0
    alpha: list[float] | None = None
    """The agent's own mixture estimate (FedSoft-Async); ignored by CDFL and FedAsync."""
    msg_id: str = ""
    base: Tensor | None = None
    """The model the agent started from (as it decoded it), when the service knows it; CDFL
    otherwise uses its own record of what it sent (only kept for estimators that need it)."""
    sketch: np.ndarray | None = None
    """The agent's data sketch (fedmq/sketch.py), for CDFL's sketch estimator."""
    noised: bool = False
    """Trained with DP-SGD: CDFL's delta rule would add its noise to the clusters whole, so
    such an upload takes the pull rule (docs/privacy.md)."""


@dataclass
class Reply:
    """What goes back to one agent: one personalized/global model, or all cluster models."""

    agent: str
    epoch: int
    vectors: list[Tensor]
    kind: str
    """personalized (CDFL), clusters (FedSoft-Async: all K) or global (FedAsync)."""
    alpha: list[float] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    """staleness, stale, betas, estimator diagnostics, seconds: logged and recorded, not sent."""


class UploadLedger:
    """Who uploaded at which clock: staleness that one agent cannot inflate.

    The papers' staleness d = t - tau counts every upload since the model an agent started
    from, so one agent uploading 20x as often as another makes the other's uploads stale
    (with 2 agents, 2 uploads of one between two of the other suffice). With `cap` c >= 1
    each agent's uploads in (tau, t) count at most c times: with c = 1, d = 1 + the number of
    agents that uploaded since tau, however often. c = 0 counts every upload (the papers').
    The trade-off: an agent back from a long absence gets d <= 1 + agents, hinge-discounted
    rather than cut by tau0 (docs/reliability.md)."""

    def __init__(self, cap: int = 1) -> None:
        if cap < 0:
            raise ValueError(f"staleness_cap must be >= 0, got {cap}")
        self.cap = int(cap)
        self.recent: dict[str, deque[int]] = {}
        """Agent -> clocks of its last `cap` uploads."""

    def staleness(self, tau: int, clock: int) -> int:
        """Staleness of an upload started from clock `tau`, applied at clock `clock`."""
        counted = clock - int(tau)
        if self.cap == 0:
            return counted
        return min(counted, 1 + sum(sum(1 for e in q if e > tau) for q in self.recent.values()))

    def record(self, agent: str, clock: int) -> None:
        if self.cap:
            self.recent.setdefault(agent, deque(maxlen=self.cap)).append(int(clock))

    def state_dict(self) -> dict[str, list[int]]:
        return {a: list(q) for a, q in self.recent.items()}

    def load_state_dict(self, d: dict[str, list[int]]) -> None:
        self.recent = {str(a): deque((int(e) for e in q), maxlen=max(1, self.cap)) for a, q in d.items()}


def check_vector(vector: Tensor, numel: int, what: str = "upload") -> Tensor:
    """A 1-D finite float32 CPU vector of the right length, or ValueError saying why."""
    if not isinstance(vector, Tensor):
        raise ValueError(f"{what}: expected a torch.Tensor, got {type(vector).__name__}")
    if vector.ndim != 1 or vector.numel() != numel:
        raise ValueError(f"{what}: vector of shape {tuple(vector.shape)}, expected ({numel},)")
    vector = vector.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(vector).all()):
        raise ValueError(f"{what}: vector has non-finite values")
    return vector


def check_alpha(alpha: Any, k: int, tol: float = 1e-3) -> list[float]:
    """K non-negative finite values summing to 1 (within tol), or ValueError with the reason."""
    if alpha is None:
        raise ValueError(f"alpha missing: expected {k} mixture weights")
    try:
        values = [float(a) for a in alpha]
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a list of {k} numbers, got {alpha!r}") from None
    if len(values) != k:
        raise ValueError(f"alpha has {len(values)} values, expected {k}")
    if not all(math.isfinite(a) for a in values):
        raise ValueError(f"alpha has non-finite values: {values}")
    if any(a < 0 for a in values):
        raise ValueError(f"alpha has negative values: {values}")
    total = sum(values)
    if abs(total - 1.0) > tol:
        raise ValueError(f"alpha sums to {total:.6g}, expected 1 (tolerance {tol})")
    return [a / total for a in values]


class Strategy(ABC):
    """Server side of one algorithm. All state lives here and in `state_dict()`."""

    name: str = "strategy"

    def __init__(self) -> None:
        self.uploads_applied = 0
        """t, the server's logical clock: uploads applied so far (stale or not, each moves it
        by one). The wire calls it `epoch` (docs/protocol.md); an agent's `tau` is the value its
        model was sent at, so staleness counts uploads, not training epochs or seconds."""
        self.counters: Counter[str] = Counter()

    @abstractmethod
    def join(self, agent: str, n_samples: int = 0) -> Reply:
        """A new (or returning) agent asks for a model to start from."""

    @abstractmethod
    def apply(self, upload: Upload, alpha: list[float] | None = None, sent: Tensor | None = None) -> Reply:
        """Apply one upload; a given alpha (journal replay) replaces the strategy's own estimate,
        and a given `sent` (journal replay) is the reply vector, so a trained reply is not
        trained again. Strategies whose replies cost nothing ignore `sent`."""

    def check(self, upload: Upload) -> None:  # noqa: B027 (an optional hook, not abstract)
        """Refuse an upload this strategy cannot apply (raise ValueError with the reason)
        before it joins a batch; the service answers it with an error and applies the rest."""

    def update(self, upload: Upload) -> Reply:
        return self.update_many([upload])[0]

    def update_many(self, uploads: list[Upload]) -> list[Reply]:
        """Apply queued uploads in order; strategies with costly estimation batch it."""
        return [self.apply(u) for u in uploads]

    @abstractmethod
    def server_models(self) -> Tensor:
        """The models the server holds, (M, P): the K cluster models, or (1, P) for one global
        model. Accuracy metrics, the status and the simulator read these, never attributes."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly (tensors allowed)."""

    @abstractmethod
    def load_state_dict(self, d: dict[str, Any]) -> None: ...


class GlobalModelStrategy(Strategy):
    """One global model that every reply carries (FedAsync, FedBuff): what they share."""

    def __init__(self, spec: Any, initial: Tensor, staleness_cap: int = 1) -> None:
        super().__init__()
        self.spec = spec
        self.model = check_vector(initial, spec.numel, "initial model").clone()
        self.ledger = UploadLedger(staleness_cap)

    def server_models(self) -> Tensor:
        return self.model[None]

    def _reply(self, agent: str, info: dict[str, Any]) -> Reply:
        return Reply(agent=agent, epoch=self.uploads_applied, vectors=[self.model.clone()], kind="global",
                     alpha=None, info=info)

    def join(self, agent: str, n_samples: int = 0) -> Reply:
        self.counters["joins"] += 1
        return self._reply(agent, {"join": True})

    def _check_state(self, d: dict[str, Any]) -> None:
        if d.get("algorithm") != self.name or d.get("spec") != self.spec.hash:
            raise ValueError(f"state for {d.get('algorithm')!r}/{d.get('spec')} does not fit "
                             f"{self.name}/{self.spec.hash}")
