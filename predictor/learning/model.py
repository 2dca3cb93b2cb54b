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
``weights_only=True``: a model file can never run code. The file also holds the
counting forecasters the online learner keeps beside the model (``counts``,
``learning.counting.Counts``): both are learnt from the same labels, and an
operator moves one file between hosts. A file without them starts them at their
priors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import numpy as np
import torch
from torch import nn

from kvstore.errors import ConfigError
from kvstore.predictor.learning.counting import Counts
from kvstore.predictor.learning.portable import interpolate, logit

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

DEFAULT_LR = 1e-2
"""Adam's step size. Chosen on the first half of the Mooncake conversation trace only
(prequential AUC at 10 min, MLP of 16: 0.59 at 1e-2, 0.56 at 3e-3, 0.58 at 3e-2):
with one step per batch of labels, a smaller step leaves the model near its prior
for most of an hour (``docs/predictor_features.md``)."""


@dataclass(frozen=True)
class Rehearsal:
    """Extra optimiser steps on a random sample of recent labels, after each update.

    Online, every label is seen once, in one step of a batch of a few: a small
    network then stays close to a linear model (one pass over the first half of
    the Mooncake trace: AUC 0.68 at 10 min; five passes: 0.73). Rehearsing keeps
    the last ``window`` labelled rows and, after each update, takes a step on
    ``batch`` of them drawn at random for every ``every`` rows labelled, so each
    label is revisited while it is recent. Chosen on the first half of that trace only (AUC at
    10 min 0.591 without; 0.606 with 2 steps of 1024 per 10 s window of labels,
    about one per 32 labels; 1 of 256: 0.596; 4 of 1024: 0.595); over the whole
    trace it lifts the 10-minute AUC from 0.637 to 0.684.

    Off by default (``ReturnModel(rehearsal=None)``): on the generated sessions of
    the planted-rule test it costs 0.02 AUC and 0.035 Brier at 60 s (more steps
    per label, noisier on a stationary rule). The replay turns it on
    (``ReplayConfig.rehearsal``); a daemon may, where traffic looks like Mooncake's.
    """

    window: int = 8192
    batch: int = 1024
    every: int = 32
    """One rehearsal step per ``every`` newly labelled rows, however they are batched:
    a learner that is fed label by label (the daemon, ticking at every event) and
    one fed in 10 s windows rehearse alike."""


REHEARSAL = Rehearsal()
"""What the replay, ``train-predictor`` and the ablation rehearse with."""


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
    return tuple(min(max(interpolate(math.log(h), xs, ps), 0.01), 0.99) for h in horizons)


def _softplus_inverse(y: float) -> float:
    return y + math.log(-math.expm1(-y))


class ReturnModel(nn.Module):
    """P(return within h) for every horizon h, monotone in h; ``hidden=0`` is logistic regression.

    ``update`` takes one optimiser step (Adam, ``lr``) on the batch it is given,
    then the ``rehearsal`` steps on recent labels (``None``, the default: none): the
    online learner calls it once per batch of newly known labels. The rehearsal
    ring is working memory, not saved: a reloaded model refills it. ``counts`` are the
    learner's counting tables for this model's horizons, saved with it.
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
        lr: float = DEFAULT_LR,
        rehearsal: Rehearsal | None = None,
        seed: int = 0,
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
        # float64, and initial weights drawn by numpy from ``seed``: torch's ``uniform_``
        # rounds by instruction set (``portable`` says why that matters).
        rng = np.random.default_rng(seed)
        self.body: nn.Module = nn.Identity()
        if hidden:
            layer = nn.Linear(n_features, hidden, dtype=torch.float64)
            bound = 1.0 / math.sqrt(n_features)  # nn.Linear's own initial range
            with torch.no_grad():
                for parameter in (layer.weight, layer.bias):
                    draws = (2.0 * rng.random(tuple(parameter.shape)) - 1.0) * bound
                    parameter.copy_(torch.from_numpy(draws))
            self.body = nn.Sequential(layer, nn.Tanh())
        self.head = nn.Linear(hidden or n_features, len(horizons), dtype=torch.float64)
        logits = [logit(p) for p in prior]
        steps = [max(b - a, _MIN_INCREMENT) for a, b in pairwise(logits)]
        with torch.no_grad():
            self.head.weight.zero_()
            self.head.bias.copy_(
                torch.tensor([logits[0], *map(_softplus_inverse, steps)], dtype=torch.float64)
            )
        self.optimizer = torch.optim.Adam(self.parameters(), lr=lr)
        self.rehearsal = rehearsal
        # The rehearsal ring: rows, labels and masks of the last ``window`` labelled rows.
        window = rehearsal.window if rehearsal is not None else 0
        self._seen_x = np.zeros((window, n_features), dtype=np.float64)
        self._seen_y = np.zeros((window, len(horizons)), dtype=np.float64)
        self._seen_m = np.zeros((window, len(horizons)), dtype=bool)
        self._seen = 0  # rows ever remembered; the ring holds the last ``window``
        self._due = 0  # labelled rows not yet paid for with a rehearsal step
        self._rng = rng  # seeded: a replay must repeat exactly
        self.counts = Counts.fresh(horizons)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of P(return within h), shape ``(n, H)``, nondecreasing along ``H``."""
        std = (self.feature_var + _VAR_FLOOR).sqrt()
        z = ((x - self.feature_mean) / std).clamp(-_CLAMP, _CLAMP)
        out = self.head(self.body(z))
        return torch.cat([out[:, :1], out[:, :1] + nn.functional.softplus(out[:, 1:]).cumsum(1)], 1)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Probabilities for one feature vector ``(F,) -> (H,)`` or a batch ``(n, F) -> (n, H)``."""
        x = self._tensor(features)
        with torch.no_grad():
            p = torch.sigmoid(self(x.reshape(-1, self.n_features))).numpy()
        return p[0] if x.dim() == 1 else p

    def update(self, features: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
        """One optimiser step on the labelled entries (then the ``rehearsal`` steps on
        recent ones); returns the mean log loss of this batch before the step.

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
        y = torch.as_tensor(np.asarray(labels, dtype=np.float64)).reshape(len(x), -1)
        m = torch.as_tensor(np.asarray(mask, dtype=bool)).reshape(y.shape)
        if not m.any():
            return 0.0
        self._observe(x)
        loss = self._step(x, y, m)
        if self.rehearsal is not None:
            self._remember(x, y, m)
            held = min(self._seen, self.rehearsal.window)
            self._due += int(m.any(dim=1).sum())
            while self._due >= self.rehearsal.every:
                self._due -= self.rehearsal.every
                rows = self._rng.choice(held, min(held, self.rehearsal.batch), replace=False)
                self._step(
                    torch.from_numpy(self._seen_x[rows]),
                    torch.from_numpy(self._seen_y[rows]),
                    torch.from_numpy(self._seen_m[rows]),
                )
        return loss / int(m.sum())

    def _step(self, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> float:
        """One Adam step on the summed log loss of the entries ``m`` marks; returns it."""
        loss = nn.functional.binary_cross_entropy_with_logits(self(x)[m], y[m], reduction="sum")
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.detach())

    def _remember(self, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor) -> None:
        """Put a labelled batch in the rehearsal ring, overwriting the oldest rows."""
        window = self._seen_x.shape[0]
        for row in range(len(x)):
            slot = self._seen % window
            self._seen_x[slot] = x[row].numpy()
            self._seen_y[slot] = y[row].numpy()
            self._seen_m[slot] = m[row].numpy()
            self._seen += 1

    def save(self, path: Path) -> None:
        """Weights, feature statistics, optimiser state and shape, as tensors and numbers only."""
        torch.save(
            {
                "format": _FORMAT,
                "n_features": self.n_features,
                "horizons": list(self.horizons),
                "hidden": self.hidden,
                "lr": self.lr,
                "rehearsal": None
                if self.rehearsal is None
                else [self.rehearsal.window, self.rehearsal.batch, self.rehearsal.every],
                "state": self.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "counts": self.counts.to_state(),
            },
            path,
        )

    @classmethod
    def load(cls, path: Path) -> ReturnModel:
        """A model saved by ``save``; ``weights_only=True``, so loading never unpickles code."""
        data = torch.load(path, map_location="cpu", weights_only=True)
        if data.get("format") != _FORMAT:
            raise ConfigError(f"{path}: not a return model file of format {_FORMAT}")
        shape = data.get("rehearsal")  # None: off, as in files saved before rehearsal
        rehearsal = None if shape is None else Rehearsal(*shape)
        model = cls(
            data["n_features"], data["horizons"], data["hidden"], lr=data["lr"], rehearsal=rehearsal
        )
        model.load_state_dict(data["state"])
        model.optimizer.load_state_dict(data["optimizer"])
        counts = data.get("counts")
        if counts is not None:
            try:
                model.counts = Counts.from_state(counts, model.horizons)
            except ConfigError as error:
                raise ConfigError(f"{path}: {error}") from None
        return model

    def _tensor(self, features: np.ndarray) -> torch.Tensor:
        x = torch.as_tensor(np.asarray(features, dtype=np.float64))
        if x.dim() not in (1, 2) or x.shape[-1] != self.n_features:
            raise ConfigError(
                f"the model takes {self.n_features} features, got shape {tuple(x.shape)} "
                "(was it saved with another feature list?)"
            )
        return x

    @torch.no_grad()
    def _observe(self, x: torch.Tensor) -> None:
        """Fold a batch into the running mean and variance (Welford, windowed)."""
        for row in x:
            self.feature_count += 1
            n = min(float(self.feature_count), STATS_WINDOW)
            delta = row - self.feature_mean
            self.feature_mean += delta / n
            self.feature_var += (delta * (row - self.feature_mean) - self.feature_var) / n
