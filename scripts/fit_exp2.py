"""Fit the cubic behind ``kernels.sm90.exp2_poly``: 2^f on [0, 1) as 1 + f*(c1 + f*(c2 + f*c3)).

    python scripts/fit_exp2.py            # prints the coefficients (float32) and their error

Minimizes the maximum *relative* error (P keeps 8 significant bits in bf16, so what matters is
error relative to the value) by iteratively reweighted least squares, with c0 = 1 held so that
2^0 is exact. The error is that of the float32 coefficients, evaluated in float64.
"""

from __future__ import annotations

import numpy as np

GRID = np.linspace(0.0, 1.0, 20001)


def max_relative_error(coeffs) -> float:
    """Max over [0, 1] of |p(f) / 2^f - 1| for p = 1 + f*(c1 + f*(c2 + f*c3)) (coeffs = c1, c2, c3)."""
    c1, c2, c3 = (float(np.float32(c)) for c in coeffs)
    p = 1.0 + GRID * (c1 + GRID * (c2 + GRID * c3))
    return float(np.abs(p / 2.0 ** GRID - 1.0).max())


def fit(iterations: int = 200) -> tuple:
    y = 2.0 ** GRID
    basis = np.stack([GRID ** k for k in (1, 2, 3)], axis=1) / y[:, None]  # relative-error columns
    target = (y - 1.0) / y
    w = np.ones_like(GRID)
    for _ in range(iterations):
        sw = np.sqrt(w)
        c, *_ = np.linalg.lstsq(basis * sw[:, None], target * sw, rcond=None)
        err = np.abs(basis @ c - target)
        w = w * np.sqrt(err / err.max() + 1e-3)  # weight up where the error peaks (Lawson)
        w /= w.sum()
    return tuple(float(np.float32(x)) for x in c)


if __name__ == "__main__":
    coeffs = fit()
    print("EXP2_POLY =", coeffs)
    print(f"max relative error {max_relative_error(coeffs):.3g}")
