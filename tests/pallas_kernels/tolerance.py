"""The closeness check the kernel tests share: a result against a float64 expectation."""

import numpy as np


def assert_close_to_scale(got, want, *, tol: float) -> None:
    """`got` equals `want` to `tol` of the expectation's largest magnitude (at least 1):
    relative error `tol`, absolute error `tol * scale`."""
    want = np.asarray(want, np.float64)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale)
