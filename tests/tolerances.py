"""Tolerances for comparing float32 results with hand-computed float64 values.

A float32 composite (softmax, log, KL, a sum over a batch) carries a few to a
few dozen roundings of float32's machine epsilon (1.19e-7), and the exact
count depends on the CPU's vector width and the library's kernels. A check at
1e-6 is about eight epsilons: it passes on one machine and fails on another.
``F32_TOL`` leaves a hundred epsilons, still far below any real error in the
formulas these tests pin down (a wrong term moves results by 1e-2 or more).
"""

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)
#: relative or absolute tolerance for a float32 result against its float64 value
F32_TOL = 100 * F32_EPS
