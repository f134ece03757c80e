"""Parameters without a gradient keep ``.grad`` None across ranks (4 gloo ranks).

The replicas' and tied copies' gradient sums gave every parameter of a rank a gradient,
zeros where none was computed anywhere (a frozen weight, a parameter the step never
used), where one device leaves ``None``; an optimizer with weight decay or momentum then
moved those parameters (AdamW decayed a frozen weight), silently.
"""

from __future__ import annotations

import pytest

from tests.integration import dist_unused_workers as UW
from tests.integration import dist_workers as W

pytestmark = W.MULTIPROCESS

TOL = 1e-10


@pytest.fixture(scope="module")
def run() -> W.Launch:
    return W.launch(UW.job_idle_parameters, world=4, limit=90)


@pytest.mark.parametrize("case", ["replicas", "replicas_stepped", "tied"])
def test_parameters_without_gradient_stay_without_one(run: W.Launch, case: str) -> None:
    for r in range(4):
        res = run.ok(r)[case]
        assert res["presence"] == [], f"rank {r}: gradient None on one side only: {res}"
        assert res["grad_error"] < TOL, f"rank {r}: gradient differs by {res['grad_error']}"
        assert res["value_error"] < TOL, f"rank {r}: parameters differ by {res['value_error']}"
