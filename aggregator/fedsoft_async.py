"""FedSoft-Async: agents download all K cluster models and estimate their mixture themselves.

The agent sets alpha_k to the share of its own samples on which w_k has the lowest loss,
trains with proximal terms toward each w_k and uploads (v, alpha); the server validates
alpha and updates the clusters exactly as CDFL's step 3 (same staleness rule and hinge).
It costs K models per download and needs no proxy data on the server.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from aggregator.cdfl import SoftClusters
from aggregator.strategy import Reply, Upload, check_alpha, check_vector
from fedmq.config import CDFLSettings
from fedmq.models import ModelSpec


class FedSoftAsync(SoftClusters):
    name = "fedsoft-async"

    @classmethod
    def from_settings(cls, spec: ModelSpec, clusters: Any, settings: CDFLSettings) -> FedSoftAsync:
        return cls(spec, clusters, tau0=settings.tau0, beta0=settings.beta0,
                   hinge_a=settings.hinge_a, hinge_b=settings.hinge_b, staleness_cap=settings.staleness_cap)

    def _clusters_reply(self, agent: str, info: dict[str, Any], alpha: list[float] | None) -> Reply:
        self.last_reply_version[agent] = self.uploads_applied
        return Reply(agent=agent, epoch=self.uploads_applied, vectors=[w.clone() for w in self.clusters],
                     kind="clusters", alpha=alpha, info=info)

    def join(self, agent: str, n_samples: int = 0) -> Reply:
        self._see(agent)
        self.counters["joins"] += 1
        return self._clusters_reply(agent, {"join": True}, None)

    def check(self, upload: Upload) -> None:
        check_alpha(upload.alpha, self.k)

    def apply(self, upload: Upload, alpha: list[float] | None = None, sent: Tensor | None = None) -> Reply:
        """Validates everything before any change: a bad alpha or vector raises ValueError."""
        alpha = check_alpha(alpha if alpha is not None else upload.alpha, self.k)
        vector = check_vector(upload.vector, self.spec.numel, f"upload from {upload.agent}")
        info = self._step(upload, vector, alpha)
        return self._clusters_reply(upload.agent, info, alpha)

    def state_dict(self) -> dict[str, Any]:
        return {**self._base_state(), "algorithm": self.name}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("algorithm") != self.name:
            raise ValueError(f"state is for {d.get('algorithm')!r}, not {self.name!r}")
        self._load_base(d)
