"""ReturnModel: prior, monotone horizons, learning, masked labels, persistence without pickle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.predictor.learning.model import (
    DEFAULT_HORIZONS,
    Rehearsal,
    ReturnModel,
    default_prior,
)

torch.set_num_threads(1)
N_FEATURES = 6


def test_default_prior_follows_the_published_waits() -> None:
    p60, p600, p3600 = default_prior(DEFAULT_HORIZONS)
    assert p60 == pytest.approx(0.46, abs=0.02)  # median wait ~86 s
    assert p600 == pytest.approx(0.84, abs=0.02)  # 76-80% within 5 min, p90 ~21 min
    assert p3600 == pytest.approx(0.93, abs=0.02)  # p99 ~14 h
    assert default_prior([1e7]) == (0.99,)


@pytest.mark.parametrize("hidden", [0, 16])
def test_untrained_model_predicts_the_prior_for_any_input(hidden: int) -> None:
    model = ReturnModel(N_FEATURES, hidden=hidden, prior=(0.3, 0.6, 0.9))
    x = np.random.default_rng(0).normal(size=(5, N_FEATURES)) * 100
    np.testing.assert_allclose(model.predict(x), np.tile([0.3, 0.6, 0.9], (5, 1)), rtol=1e-5)
    assert model.predict(x[0]).shape == (3,)


def test_a_flat_prior_still_gives_increasing_horizons() -> None:
    p = ReturnModel(N_FEATURES, prior=(0.5, 0.5, 0.5)).predict(np.zeros(N_FEATURES))
    assert p[0] == pytest.approx(0.5, abs=1e-6) and p[0] < p[1] < p[2] < 0.501


@pytest.mark.parametrize("hidden", [0, 16])
def test_probabilities_are_monotone_across_horizons_for_random_weights(hidden: int) -> None:
    torch.manual_seed(0)
    model = ReturnModel(N_FEATURES, horizons=(10, 60, 300, 600, 3600, 86400), hidden=hidden)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 3.0)
    x = np.random.default_rng(1).normal(size=(2000, N_FEATURES)) * 10
    p = model.predict(x)
    assert p.shape == (2000, 6)
    assert (np.diff(p, axis=1) >= 0).all()
    assert ((p >= 0) & (p <= 1)).all()


def test_updates_move_predictions_toward_the_labels() -> None:
    rng = np.random.default_rng(0)
    model = ReturnModel(N_FEATURES, hidden=0, lr=0.05)
    x = rng.normal(size=(200, N_FEATURES))
    y = (x[:, :1] > 0).repeat(3, axis=1).astype(np.float32)  # feature 0 decides every horizon
    for i in range(200):
        model.update(x[i], y[i], np.ones(3, dtype=bool))
    p = model.predict(np.array([[2.0] + [0.0] * 5, [-2.0] + [0.0] * 5]))
    assert p[0, 0] > 0.8 and p[1, 2] < 0.2


def test_an_empty_mask_learns_nothing() -> None:
    model = ReturnModel(N_FEATURES)
    x = np.ones(N_FEATURES)
    before = model.predict(x)
    assert model.update(x, np.ones(3), np.zeros(3, dtype=bool)) == 0.0
    np.testing.assert_array_equal(model.predict(x), before)
    assert float(model.feature_count) == 0.0


@pytest.mark.parametrize("rehearsal", [None, Rehearsal(window=64, batch=8, every=1)])
def test_save_and_load_round_trip_is_exact(tmp_path: Path, rehearsal: Rehearsal | None) -> None:
    rng = np.random.default_rng(0)
    model = ReturnModel(N_FEATURES, horizons=(30, 300), hidden=8, lr=0.02, rehearsal=rehearsal)
    for _ in range(30):
        model.update(
            rng.normal(size=(2, N_FEATURES)), rng.random((2, 2)) < 0.5, rng.random((2, 2)) < 0.8
        )
    path = tmp_path / "model.pt"
    model.save(path)
    torch.load(path, weights_only=True)  # plain tensors and numbers: no pickled classes

    loaded = ReturnModel.load(path)
    assert (loaded.horizons, loaded.hidden, loaded.lr) == ((30.0, 300.0), 8, 0.02)
    assert loaded.rehearsal == rehearsal
    x = rng.normal(size=(50, N_FEATURES))
    np.testing.assert_array_equal(loaded.predict(x), model.predict(x))
    if rehearsal is not None:
        return  # the rehearsal ring is working memory, not saved: later steps differ
    # The optimiser state and feature statistics travel too: learning continues identically.
    labels, mask = np.ones((1, 2)), np.ones((1, 2), dtype=bool)
    model.update(x[:1], labels, mask)
    loaded.update(x[:1], labels, mask)
    np.testing.assert_array_equal(loaded.predict(x), model.predict(x))


def test_a_file_that_is_not_a_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(ConfigError):
        ReturnModel.load(path)


def test_bad_configuration_and_inputs_are_refused() -> None:
    with pytest.raises(ConfigError):
        ReturnModel(N_FEATURES, horizons=(600, 60))
    with pytest.raises(ConfigError):
        ReturnModel(N_FEATURES, prior=(0.5, 1.0, 1.0))
    with pytest.raises(ConfigError, match="feature list"):
        ReturnModel(N_FEATURES).predict(np.zeros(N_FEATURES + 1))


def test_rehearsal_revisits_recent_labels_and_learns_faster() -> None:
    """The same 40 labels of a planted rule, one at a time: rehearsing them ranks better."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(40, N_FEATURES))
    labels = (x[:, :1] > 0).repeat(2, axis=1)
    mask = np.ones_like(labels, dtype=bool)
    plain = ReturnModel(N_FEATURES, horizons=(30, 300), rehearsal=None)
    rehearsed = ReturnModel(N_FEATURES, horizons=(30, 300), rehearsal=Rehearsal(64, 16, 1))
    for model in (plain, rehearsed):
        for i in range(len(x)):
            model.update(x[i : i + 1], labels[i : i + 1], mask[i : i + 1])
    test = rng.normal(size=(400, N_FEATURES))
    truth = test[:, 0] > 0

    def separation(model: ReturnModel) -> float:
        p = model.predict(test)[:, 0]
        return float(p[truth].mean() - p[~truth].mean())

    assert separation(rehearsed) > separation(plain) + 0.05
