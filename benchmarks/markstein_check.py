"""CPU check that dividing by the row scale as Markstein does is correctly rounded (so exact as `div_rn`).

For fp8 row quantization the divisor is one bf16 scale per row: `q0 = RN(f * RN(1/s))`, `r = RN(f - q0 * s)` (exact
with an FMA), `q = RN(q0 + r * RN(1/s))` is RN(f / s) for every f (Markstein's theorem); this samples bf16 values and
scales as the kernel sees them and compares against exact rational arithmetic rounded once to float32.

    python benchmarks/markstein_check.py        # 100,000 pairs, ~1 min; prints the mismatches (0 expected)
"""

from fractions import Fraction as Fr
import numpy as np, random, math
def rn32(x: Fr) -> float:
    """Correctly rounded (nearest-even) float32 of an exact rational (normal range)."""
    if x == 0: return 0.0
    sign = -1 if x < 0 else 1; x = abs(x)
    e = math.floor(math.log2(x.numerator) - math.log2(x.denominator))
    while Fr(2)**e > x: e -= 1
    while Fr(2)**(e+1) <= x: e += 1
    m = x / Fr(2)**(e-23)            # in [2^23, 2^24)
    i = m.numerator // m.denominator; r = m - i
    if r > Fr(1,2) or (r == Fr(1,2) and i % 2 == 1): i += 1
    return sign * float(Fr(i) * Fr(2)**(e-23))
def bf16(v: float) -> float:
    a = np.array([v], dtype=np.float32).view(np.uint32)[0]
    lsb = (a >> 16) & 1; a = (a + 0x7FFF + lsb) & 0xFFFF0000
    return float(np.array([a], dtype=np.uint32).view(np.float32)[0])
random.seed(0); bad = 0; N = 100000  # noqa: E702
for k in range(N):
    amax = bf16(abs(random.gauss(0, 1)) * 10 ** random.uniform(-3, 3)) or 1.0
    s = bf16(rn32(Fr(amax) / 448))
    f = bf16(random.uniform(-amax, amax)) if k % 2 else bf16(amax * random.choice([1, -1]) * random.random()**3)
    exact = rn32(Fr(f) / Fr(s))
    y = rn32(Fr(1) / Fr(s))
    q0 = rn32(Fr(f) * Fr(y))
    r = rn32(Fr(f) - Fr(q0) * Fr(s))      # fma(-q0, s, f)
    q = rn32(Fr(q0) + Fr(r) * Fr(y))      # fma(r, y, q0)
    bad += q != exact
print("mismatches", bad, "of", N)
