"""Evidence sentences of the why-engine say only what the recorded data shows (issue 17 item 9)."""

from __future__ import annotations

import math

import pandas as pd

from nantrace._facts import grad_norm_text


def test_grad_norm_trend_quotes_first_and_last_values_with_their_steps() -> None:
    norms = pd.Series({3: 19.0, 4: math.inf, 5: 943.0}, dtype="float64")
    assert grad_norm_text(norms, [3, 4, 5]) == ", gradient norm 19 (step 3) → 943 (step 5)"


def test_grad_norm_recorded_once_is_not_a_trend() -> None:
    # The old text read "gradient norm 0.4703 → 0.4703" when only one step had a finite value.
    norms = pd.Series({7: 0.4703, 8: math.nan}, dtype="float64")
    assert grad_norm_text(norms, [7, 8, 9]) == ", gradient norm 0.4703 at step 7 (recorded once)"


def test_grad_norm_never_recorded_says_so() -> None:
    assert grad_norm_text({}, [1, 2]) == ", gradient norm not recorded"
