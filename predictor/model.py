"""``ReturnModel``: P(the session returns within h seconds) for several horizons at once.

Shape of the model::

    features ──standardise──► body ──► head ──► z[0], z[1], ..., z[H-1]
    (running mean/var        (identity if hidden=0,   logit(h_0) = z[0]
     in buffers, clamp ±5)    else Linear+tanh)       logit(h_k) = z[0] + sum_{j<=k} softplus(z[j])

Why this shape:

- **Monotone by construction.** P(return within 10 min) can never fall below
  P(return within 1 min): each longer horizon adds a positive (softplus)
  increment to the shorter one's logit. Separate heads would cross on
  unusual inputs, and a policy reading crossed probabilities makes nonsense
  placements. The increments still depend on the features, so a feature may
  matter at one minute and not at an hour.
- **Starts at the prior.** The head's weights start at zero and its bias
  at the logits of the base rates, so an untrained model predicts the
  published return-time distribution for every session, and online learning
  only has to learn departures from it.
- **Calibrated.** Trained with the logistic loss on the observed labels, so
  its outputs are probabilities, not scores: the policy compares them with
  cost thresholds.
- **Running standardisation in buffers.** Features arrive one at a time, so
  there is no dataset to fit a scaler on; mean and variance are updated from
  the features of every labelled batch (a window of ``STATS_WINDOW`` samples
  lets them follow a drifting workload) and saved with the weights.

Persistence is ``torch.save`` of plain tensors and numbers, loaded with
``weights_only=True``: a model file can never run code.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvstore.errors import ConfigError

DEFAULT_HORIZONS = (60.0, 600.0, 3600.0)

PUBLISHED_WAITS: tuple[tuple[float, float], ...] = (
    (1.0, 0.0),
    (86.0, 0.5),
    (300.0, 0.78),
    (1236.0, 0.9),
    (50040.0, 0.99),
)
"""(seconds, P(human wait <= seconds)) from TraceLab's published figures: median ~86 s,
76-80% within 5 min, p90 20.6 min, p99 13.9 h (docs: shared/reference/perf_anchors.md §5)."""

STATS_WINDOW = 10_000
"""The running feature statistics weigh about this many recent samples."""

_FORMAT = 1
_MIN_INCREMENT = 1e-3  # logit step between horizons when the prior gives none
_CLAMP = 5.0  # standardised features are clamped to ±5: a first-seen value cannot blow up a logit
_VAR_FLOOR = 1e-4


def default_prior(horizons: Sequence[float]) -> tuple[float, ...]:
    """P(return within h) for each horizon, from ``PUBLISHED_WAITS`` interpolated in log time."""
    xs = [math.log(s) for s, _ in PUBLISHED_WAITS]
    ps = [p for _, p in PUBLISHED_WAITS]
    return tuple(float(np.clip(np.interp(math.log(h), xs, ps), 0.01, 0.99)) for h in horizons)


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def _softplus_inverse(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class ReturnModel(nn.Module):
    """P(return within h) for every horizon h, monotone in h; ``hidden=0`` is logistic regression.

    ``update`` takes one optimiser step (Adam, ``lr``) per call: the online
    learner calls it once per batch of newly known labels.
    """

    feature_mean: torch.Tensor
    feature_var: torch.Tensor
    feature_count: torch.Tensor

    def __init__(
        self,
        n_features: int,
        horizons: Sequence[float] = DEFAULT_HORIZONS,
        hidden: int = 16,
        prior: Sequence[float] | None = None,
        lr: float = 3e-3,
    ) -> None:
        super().__init__()
        horizons = tuple(float(h) for h in horizons)
        if not horizons or horizons[0] <= 0 or any(a >= b for a, b in pairwise(horizons)):
            raise ConfigError(f"horizons must be positive and increasing, got {horizons}")
        if n_features <= 0 or hidden < 0:
            raise ConfigError("n_features must be positive and hidden non-negative")
        prior = tuple(default_prior(horizons) if prior is None else prior)
        if len(prior) != len(horizons) or not all(0.0 < p < 1.0 for p in prior):
            raise ConfigError(f"prior must give one probability in (0, 1) per horizon, got {prior}")
        self.n_features = n_features
        self.horizons = horizons
        self.hidden = hidden
        self.lr = lr

        self.register_buffer("feature_mean", torch.zeros(n_features, dtype=torch.float64))
        self.register_buffer("feature_var", torch.ones(n_features, dtype=torch.float64))
        self.register_buffer("feature_count", torch.zeros((), dtype=torch.float64))
        self.body: nn.Module = (
            nn.Sequential(nn.Linear(n_features, hidden), nn.Tanh()) if hidden else nn.Identity()
        )
        self.head = nn.Linear(hidden or n_features, len(horizons))
        logits = [_logit(p) for p in prior]
        steps = [max(b - a, _MIN_INCREMENT) for a, b in pairwise(logits)]
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.copy_(torch.tensor([logits[0], *map(_softplus_inverse, steps)]))
        self.optimizer = torch.optim.Adam(self.parameters(), lr=lr)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of P(return within h), shape ``(n, H)``, nondecreasing along ``H``."""
        std = (self.feature_var + _VAR_FLOOR).sqrt()
        z = ((x.double() - self.feature_mean) / std).clamp(-_CLAMP, _CLAMP).float()
        out = self.head(self.body(z))
        return torch.cat([out[:, :1], out[:, :1] + nn.functional.softplus(out[:, 1:]).cumsum(1)], 1)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Probabilities for one feature vector ``(F,) -> (H,)`` or a batch ``(n, F) -> (n, H)``."""
        x = self._tensor(features)
        with torch.no_grad():
            p = torch.sigmoid(self(x.reshape(-1, self.n_features))).double().numpy()
        return p[0] if x.dim() == 1 else p

    def update(self, features: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
        """One optimiser step on the labelled entries; returns their mean log loss.

        ``labels[i, k]`` is 1 if example ``i`` returned within horizon ``k``;
        ``mask[i, k]`` says whether that label is known in this batch (others
        are ignored, so one example can be labelled horizon by horizon).

        The loss is *summed* over the labelled entries, so every label weighs
        the same whatever batch it arrives in. A mean would not: a return
        labels all horizons in one row while a passing horizon labels one, so
        averaging would weigh a quick return's 1 at 60 s a third as much as a
        passed horizon's 0, and bias every probability down.
        """
        x = self._tensor(features).reshape(-1, self.n_features)
        y = torch.as_tensor(np.asarray(labels, dtype=np.float32)).reshape(len(x), -1)
        m = torch.as_tensor(np.asarray(mask, dtype=bool)).reshape(y.shape)
        if not m.any():
            return 0.0
        self._observe(x)
        loss = nn.functional.binary_cross_entropy_with_logits(self(x)[m], y[m], reduction="sum")
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach()) / int(m.sum())

    def save(self, path: Path) -> None:
        """Weights, feature statistics, optimiser state and shape, as tensors and numbers only."""
        torch.save(
            {
                "format": _FORMAT,
                "n_features": self.n_features,
                "horizons": list(self.horizons),
                "hidden": self.hidden,
                "lr": self.lr,
                "state": self.state_dict(),
                "optimizer": self.optimizer.state_dict(),
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> ReturnModel:
        """A model saved by ``save``; ``weights_only=True``, so loading never unpickles code."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("format") != _FORMAT:
            raise ConfigError(f"{path}: not a return model file of format {_FORMAT}")
        model = cls(data["n_features"], data["horizons"], data["hidden"], lr=data["lr"])
        model.load_state_dict(data["state"])
        model.optimizer.load_state_dict(data["optimizer"])
        return model

    def _tensor(self, features: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(features, dtype=np.float32))
        if x.dim() not in (1, 2) or x.shape[-1] != self.n_features:
            raise ConfigError(
                f"the model takes {self.n_features} features, got shape {tuple(x.shape)} "
                "(was it saved with another feature list?)"
            )
        return x

    @torch.no_grad()
    def _observe(self, x: torch.Tensor) -> None:
        """Fold a batch into the running mean and variance (Welford, windowed)."""
        for row in x.double():
            self.feature_count += 1
            n = min(float(self.feature_count), STATS_WINDOW)
            delta = row - self.feature_mean
            self.feature_mean += delta / n
            self.feature_var += (delta * (row - self.feature_mean) - self.feature_var) / n
