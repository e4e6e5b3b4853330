"""CPU check that dividing by the row scale as Markstein does is correctly rounded (so exact as `div_rn`).

hookkit's "exact" fp8 row kernel (hookkit/techniques/compile/fp8_rows_triton.py) divides each bf16 value f of a row
by the row's scale s as `q0 = RN(f * y)` with `y = RN(1/s)` computed once per row, `r = RN(f - q0 * s)` (exact with
an FMA), `q = RN(q0 + r * y)`; Markstein's theorem says q is RN(f / s) for every f. This samples bf16 values and
scales as the kernel sees them (s = bf16(RN(amax / 448)), |f| <= amax) and compares q against the exact quotient
rounded once to float32, in exact rational arithmetic. tests/test_fp8_rows.py runs a small sample of it.

    python benchmarks/markstein_check.py              # 100,000 pairs, ~1 min; prints the mismatches (0 expected)
    python benchmarks/markstein_check.py --pairs 1000
"""

from __future__ import annotations

import argparse
import math
import random
import struct
from fractions import Fraction


def rn32(x: Fraction) -> Fraction:
    """The float32 nearest to the exact rational x (ties to even), as an exact rational (normal range)."""
    if x == 0:
        return Fraction(0)
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = math.floor(math.log2(x.numerator) - math.log2(x.denominator))
    while Fraction(2) ** e > x:
        e -= 1
    while Fraction(2) ** (e + 1) <= x:
        e += 1
    m = x / Fraction(2) ** (e - 23)  # in [2^23, 2^24): the 24-bit significand and what is left of it
    i, rest = m.numerator // m.denominator, m - m.numerator // m.denominator
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and i % 2 == 1):
        i += 1
    return sign * Fraction(i) * Fraction(2) ** (e - 23)


def bf16(v: float) -> Fraction:
    """The bfloat16 nearest to v (ties to even), as torch rounds float32 to bfloat16."""
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return Fraction(struct.unpack("<f", struct.pack("<I", bits))[0])


def markstein_quotient(f: Fraction, s: Fraction) -> Fraction:
    """The kernel's quotient: the correctly rounded reciprocal, then two fused multiply-adds."""
    y = rn32(1 / s)
    q0 = rn32(f * y)
    r = rn32(f - q0 * s)  # fma(-q0, s, f): exact, so rounding it changes nothing
    return rn32(q0 + r * y)  # fma(r, y, q0)


def sample(n: int, seed: int = 0) -> list[tuple[Fraction, Fraction]]:
    """n (value, scale) pairs as a row presents them: scales over six decades, values uniform or near zero."""
    rng = random.Random(seed)
    pairs = []
    for k in range(n):
        amax = bf16(abs(rng.gauss(0, 1)) * 10 ** rng.uniform(-3, 3)) or Fraction(1)
        s = bf16(float(rn32(amax / 448)))
        spread = rng.uniform(-1, 1) if k % 2 else rng.choice([1, -1]) * rng.random() ** 3
        pairs.append((bf16(float(amax) * spread), s))
    return pairs


def mismatches(pairs: list[tuple[Fraction, Fraction]]) -> list[tuple[Fraction, Fraction]]:
    """The pairs whose Markstein quotient is not the correctly rounded one."""
    return [(f, s) for f, s in pairs if markstein_quotient(f, s) != rn32(f / s)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=100_000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    bad = mismatches(sample(args.pairs, args.seed))
    print("mismatches", len(bad), "of", args.pairs)
    for f, s in bad[:10]:
        print(f"  f={float(f)!r} s={float(s)!r}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
