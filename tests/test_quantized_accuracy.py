"""`examples/quantized_accuracy.py`'s scoring: which predictions count, and how agreement and
perplexity come out of them (scorers of made-up logits; the script itself runs real models)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "quantized_accuracy.py"


def _script():
    spec = importlib.util.spec_from_file_location("quantized_accuracy", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _predicting(next_token: dict[int, int], vocab: int = 8):
    """A scorer whose top token after token t is next_token.get(t, t + 1) (mod vocab), with
    log-probability log(1/2); every other token shares the rest."""

    def logits(ids: list[int]) -> torch.Tensor:
        out = torch.full((len(ids), vocab), math.log(0.5 / (vocab - 1)))
        for row, token in enumerate(ids):
            out[row, next_token.get(token, token + 1) % vocab] = math.log(0.5)
        return out

    return logits


def test_only_predictions_from_scored_from_count():
    script = _script()
    ids = [0, 1, 2, 3, 4, 5, 6, 7]  # each token the one after the last
    # The other scorer disagrees on what follows tokens 0 and 1: the predictions of ids[1:3].
    scorers = {"reference": _predicting({}), "other": _predicting({0: 5, 1: 5})}
    whole = script.compare(scorers, [ids])
    assert whole["other"]["tokens"] == 7 and math.isclose(whole["other"]["top1"], 5 / 7)
    # every target at probability 1/2:
    assert math.isclose(whole["reference"]["ppl"], 2.0, rel_tol=1e-6)
    assert whole["other"]["ppl"] > 2.0
    later = script.compare(scorers, [ids], scored_from=3)  # ids[3:] predicted: all agree
    assert later["other"]["tokens"] == 5 and later["other"]["top1"] == 1.0
    assert math.isclose(later["other"]["ppl"], 2.0, rel_tol=1e-6)


def test_scored_from_holds_across_chunks(monkeypatch):
    script = _script()
    monkeypatch.setattr(script, "CHUNK", 4)
    ids = list(range(10))
    scorers = {"reference": _predicting({}, 16), "other": _predicting({4: 0, 8: 0}, 16)}
    # chunks read ids[0:5], ids[4:9], ids[8:10]; predictions of ids[6:] scored: 6, 7, 8, 9
    result = script.compare(scorers, [ids], scored_from=6)
    assert result["other"]["tokens"] == 4
    # the prediction of 9 (after 8) differs; of 5 (after 4), unscored
    assert math.isclose(result["other"]["top1"], 3 / 4)
