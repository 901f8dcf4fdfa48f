"""Tolerances are data: dtype facts, the (dtype, operator class) table, budget multipliers,
distribution thresholds and every other number a verdict turns on (a baseline's regression
and ratchet factors, the capture's cache disagreement); the per-operator or per-point
overrides read from pyproject.toml are ``compare.policy``.

Every number below that is not a plain default carries its reason. ``rtol`` and ``atol`` are
given together or not at all; ``None`` means "the default".

Sources:
- [torch] the defaults of ``torch.testing.assert_close`` (``_DTYPE_PRECISIONS`` in
  ``torch/testing/_comparison.py``): float16 (1e-3, 1e-5), bfloat16 (1.6e-2, 1e-5),
  float32 (1.3e-6, 1e-5), float64 (1e-7, 1e-7).
- [ieee] unit roundoff u = eps / 2 of each format (IEEE 754; OCP 8-bit FP spec for float8).
- [walk] rounding errors of a length-K reduction grow as sqrt(K) when they are independent
  (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., section 3.1).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

#: Operator classes known to the tolerance table.
OP_CLASSES: tuple[str, ...] = (
    "elementwise",
    "normalization",
    "softmax",
    "matmul",
    "attention",
    "scan",
    "selection",
    "gather-scatter",
    "quantization",
)

#: Operator classes whose outputs are sums over ``reduction_length`` terms; their absolute
#: tolerance is scaled by sqrt(reduction_length) [walk].
REDUCTION_CLASSES: frozenset[str] = frozenset(
    {"normalization", "softmax", "matmul", "attention", "scan"}
)

#: Floating dtypes by name, with the number of explicit mantissa bits and the exponent of the
#: smallest subnormal (so that ulp(x) = max(2**(floor(log2|x|) - mantissa), 2**min_subnormal)).
FLOAT_FORMATS: Mapping[str, tuple[int, int]] = {
    "float64": (52, -1074),  # [ieee] binary64
    "float32": (23, -149),  # [ieee] binary32
    "float16": (10, -24),  # [ieee] binary16
    "bfloat16": (7, -133),  # bfloat16: binary32's exponent, 7 mantissa bits
    "float8_e4m3fn": (3, -9),  # OCP FP8 E4M3: min normal 2**-6, 3 mantissa bits
    "float8_e5m2": (2, -16),  # OCP FP8 E5M2: min normal 2**-14, 2 mantissa bits
}


@dataclass(frozen=True)
class Tolerance:
    """An elementwise tolerance: ``|actual - expected| <= atol + rtol * |expected|``."""

    rtol: float
    atol: float

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol < 0 or math.isnan(self.rtol) or math.isnan(self.atol):
            raise ValueError(f"rtol and atol must be >= 0, got rtol={self.rtol}, atol={self.atol}")


#: Elementwise tolerances per dtype, for outputs computed with one rounding [torch].
DTYPE_TOLERANCES: Mapping[str, Tolerance] = {
    "float64": Tolerance(rtol=1e-7, atol=1e-7),  # [torch]
    "float32": Tolerance(rtol=1.3e-6, atol=1e-5),  # [torch]
    "float16": Tolerance(rtol=1e-3, atol=1e-5),  # [torch]
    "bfloat16": Tolerance(rtol=1.6e-2, atol=1e-5),  # [torch]
    # float8 formats: two units of roundoff relative, one min-normal absolute [ieee].
    "float8_e4m3fn": Tolerance(rtol=0.125, atol=2.0**-6),
    "float8_e5m2": Tolerance(rtol=0.25, atol=2.0**-14),
}

#: How much looser than elementwise each operator class is, as a factor on (rtol, atol).
#: A class is looser when its outputs go through more roundings before the last one.
OP_CLASS_FACTORS: Mapping[str, float] = {
    "elementwise": 1.0,
    # mean of squares, rsqrt and a scale: three roundings after the reduction.
    "normalization": 2.0,
    # max, exp, sum and divide: four roundings; exp amplifies input error by |x|.
    "softmax": 4.0,
    # one rounding of the float32 accumulator; the sqrt(K) growth is applied separately.
    "matmul": 2.0,
    # two matmuls and a softmax chained.
    "attention": 8.0,
    # a prefix sum carries the rounding of every earlier term (sqrt(K) applied separately).
    "scan": 2.0,
    "selection": 1.0,
    "gather-scatter": 1.0,
    # one rounding to the quantized grid dominates; the table's float8 rows already cover it.
    "quantization": 1.0,
}


@dataclass(frozen=True)
class Budget:
    """Multipliers of the error budget against an honest control (docs/comparison.md).

    A candidate passes when ``max_abs <= max_abs_multiplier * control.max_abs + floor`` and
    ``rel_l2 <= rel_l2_multiplier * control.rel_l2 + eps(dtype)``: the floors are one ulp at
    the truth's largest magnitude and eps, the error of the two roundings an unfused kernel
    adds where the control rounds once (an activation then a product, both in bfloat16).
    """

    #: The worst element may be 4x the control's worst: an honest kernel with another
    #: accumulation order rounds intermediates differently (double rounding gives up to 2x)
    #: and the maximum over many elements is noisy; 4x still catches a 2% error in bfloat16.
    max_abs_multiplier: float = 4.0
    #: The overall error may be 3x the control's: averages are stable, so this is tighter
    #: than the max multiplier; an honest fused kernel measured at 1.0-1.8x here.
    rel_l2_multiplier: float = 3.0


#: The control's worst error is one sample of an extreme: with heavy-tailed errors (attention
#: over scores of hundreds, where exp amplifies a score's rounding) a fresh draw of the same
#: honest error exceeds it by 3.5x across seeds (block_sparse_attention, float32, 12 seeds),
#: and a single worst element cannot say how far. The budget therefore takes the control's
#: tail extrapolated from its TAIL_ORDER_STATISTICS largest errors (exponential tail, the
#: Gumbel domain of rounding sums): the worst plus ln(1 / TAIL_EXCEEDANCE) times the mean
#: excess of the top errors over the next one, the level a fresh worst error exceeds with
#: about that probability. 32 statistics estimate the tail's scale to about 18% (1/sqrt(32));
#: 1% exceedance: one honest case in a hundred reseeds may reach the multiplier's margin,
#: which the 4x multiplier still covers.
TAIL_ORDER_STATISTICS = 32
TAIL_EXCEEDANCE = 0.01

#: A systematic scale (the error's regression on the truth, against the control's) fails when
#: it is real, shared and beyond what honest rounding leans. Real: SCALE_Z standard errors of
#: the candidate's slope (heteroscedasticity-robust, so a few large elements do not decide
#: it); at 6, about one false alarm in 5e8 tests where the errors are independent. Shared: at least
#: SCALE_MIN_ELEMENTS elements. Beyond honest rounding, the largest of:
#: - SCALE_ACCUMULATOR_ROUNDOFFS unit roundoffs (u = eps / 2) of the accumulator (float32;
#:   float64 for float64): internal roundings biased alike (a reciprocal then a product, a
#:   base-2 exponent) lean up to 1.66 u on the catalogue's float32 candidates;
#: - sqrt(K) of them for a reduction of length K: a normalizer summed in another order scales
#:   every output alike (sampling's probabilities renormalized over 151,936 tokens lean 31 u);
#: - SCALE_OUTPUT_ROUNDOFFS of the output dtype's: rounding the output to nearest is unbiased;
#:   truncating leans about half a unit roundoff and fails;
#: - for an output through exponentials, SCALE_EXPONENT_ROUNDOFFS of the accumulator's times
#:   the farthest an exponent's argument lies below its row's maximum (``exponent_reach``):
#:   a kernel that multiplies the scores by the softmax scale and log2(e), each rounded to
#:   float32 (or their product, rounded once), computes exp((x - m)(1 + d)) with |d| up to
#:   two roundoffs, and leans a row whose weights lie a distance R below its maximum by d R
#:   (an exp2 attention-sinks kernel whose sinks dominate every score by 12 leaned 8.4 u,
#:   past the other floors).
#: An RMSNorm whose sum of squares accumulates in bfloat16 leans 0.35% (0.9 u of bfloat16)
#: with every element within the 4x max-abs budget. Budget overrides that widen the relative
#: L2 multiplier widen these floors by the same factor.
SCALE_Z = 6.0
SCALE_MIN_ELEMENTS = 64
SCALE_ACCUMULATOR_ROUNDOFFS = 3.0
SCALE_OUTPUT_ROUNDOFFS = 0.25
SCALE_EXPONENT_ROUNDOFFS = 2.0

#: A capture point's lean (``compare.lean``: its error's scale on the reference, its mean
#: signed error, per channel the largest of either) fails beyond the honest ensemble's range
#: by more than LEAN_Z of the candidate's own standard errors plus LEAN_SPREAD times the
#: range's width. LEAN_Z: a point is judged per request, call, output and step, a few
#: thousand leans per set and dtype, each at three leans and their per-channel maxima (the
#: largest of up to a few hundred channels: their maximum z of honest noise sits near 3); at
#: 8, the Gaussian tail is 1e-15 per lean, and the heavier tail of a point whose error is a
#: few large elements still clears it. LEAN_SPREAD: another machine leans like a member, give
#: or take what the members differ by (the range's width once more). At least
#: LEAN_MIN_ELEMENTS finite elements: a mean of fewer resolves nothing a budget does not.
LEAN_Z = 8.0
LEAN_SPREAD = 1.0
#: ... plus an eighth of the dtype's unit roundoff, or for a reduction of length K sqrt(K)
#: roundoffs of the float32 accumulator, whichever is larger: an exact replay (float32
#: replaying the float32 reference: zero error, zero standard error) sits 1e-9 outside
#: members that lean by that much, and an honest fused RMSNorm in float32 leans 1e-7 (another
#: summation order), which is no lean at all; in bfloat16 an eighth of a rounding is 0.049%,
#: and a planted 0.1% scale (a quarter rounding) still fails.
LEAN_FLOOR_ROUNDOFFS = 0.125
LEAN_MIN_ELEMENTS = 256

#: A router's tokens that choose other experts than the reference (``compare.routing``) fail
#: beyond the honest ensemble's worst fraction of them by more than FLIP_Z standard
#: deviations of a Poisson count of that mean (one flip more in its variance, so that a
#: calibration that met no near tie still allows one). Flips come from near ties the
#: candidate's rounding moves across, independent token by token: a Poisson count. A router
#: is judged per request, call and dtype, a few hundred counts per set, and at 8 the tail
#: stays below 1e-6 per count for the small means routers have (the zoo's honest bfloat16
#: routers flip up to 3 tokens alone and up to 12 of a long request's 350 in the whole model,
#: allowed 41 there; no variant of the honest matrix used more than a third of a routing's
#: budget); a router that chooses by other scores (a bias left out of the choice) flips a
#: good share of its tokens.
FLIP_Z = 8.0
#: Rows (tokens) per channel before per-channel leans are judged: the mean of fewer rounds
#: too coarsely for its standard error to be trusted in the maximum over channels.
LEAN_CHANNEL_ROWS = 16

#: Distribution thresholds per dtype: (|norm_ratio - 1|, 1 - cosine). An honest kernel's
#: relative L2 error is about 0.3 eps (uniform rounding), so its norm ratio deviates by far
#: less and 1 - cosine is about (0.3 eps)**2 / 2; the thresholds sit well above that and below
#: "a norm off by a few percent" in the dtypes that can resolve a few percent.
DISTRIBUTION_THRESHOLDS: Mapping[str, tuple[float, float]] = {
    "float64": (1e-12, 1e-20),  # ~4500 eps; cosine error of 1e-10 relative L2
    "float32": (1e-5, 1e-10),  # ~80 eps: float32 reductions of 1e6 terms stay below
    "float16": (4e-3, 8e-6),  # 4 eps; cosine error of a 0.4% orthogonal error
    "bfloat16": (2e-2, 2e-4),  # 2.5 eps: a 2% norm error fails; cosine of a 2% error
    "float8_e4m3fn": (0.25, 3e-2),  # 2 eps
    "float8_e5m2": (0.5, 1e-1),  # 2 eps
}

#: Distribution floors against a calibrated control (a golden set's calibration), per dtype:
#: (|norm_ratio - 1|, 1 - cosine). The limit is the largest of the floor, the control's own
#: deviation times the budget's spread, and what an error as large as the control's explains
#: (``compare.distribution``), so a deep model's accumulated drift passes where it is
#: the reference's own. The norm floor is the unit roundoff u = eps / 2: round to nearest moves
#: each element by at most u relative, so one rounding cannot scale a norm by more; a 1%
#: systematic scale in bfloat16 (u = 0.0039) fails. The cosine floor is that of an error of
#: relative L2 eps, (eps**2) / 2.
CALIBRATED_DISTRIBUTION_FLOORS: Mapping[str, tuple[float, float]] = {
    name: (2.0 ** -(bits + 1), 2.0 ** -(2 * bits + 1)) for name, (bits, _) in FLOAT_FORMATS.items()
}

#: A candidate may have at most this fraction of elements more exact zeros than the truth
#: rounded to its dtype: 1% allows different underflow paths, not a zeroed-out tile.
ZERO_EXCESS_FRACTION = 0.01
#: ... and, whatever the output's size, this many: one exact cancellation (a + b == 0 in a low
#: precision) is chance, a flushed tile or row is many values. A decode step's hidden state of a
#: tiny model has 64 values, where one chance zero is 1.6%.
ZERO_EXCESS_COUNT = 1


#: A quantizer's rounding (``compare.rounding.RoundingRule``, outputs of kind "quantized") is
#: measured in steps of its codes' grid at x / scale: r = (q - x / scale) / step. Round to
#: nearest gives |r| <= 0.5; truncation gives r in (-1, 0] toward zero, 40-50% of the elements
#: off by one, all of them biased the same way.
#:
#: Elements within ROUNDING_TIE_BAND steps of a rounding tie may round either way (round half
#: away from zero is as honest as ties to even): x / s computed as x * (1 / s) in float32 is
#: off by two float32 roundings, 2**-23 of |x / s|: about 1.5e-5 steps for int8 (|x / s| <=
#: 128), 2**-19 for float8 (|x / s| is under 16 of its steps there); 1e-3 leaves 60x that and
#: stays far below any real misrounding.
ROUNDING_TIE_BAND = 1e-3
#: No element may be more than one step from the nearest grid point (|r| <= 1.5): the slack
#: of one code an honest control's codes allow, measured against the candidate's own scale.
ROUNDING_MAX_STEP_ERROR = 1.5
#: At most this share of elements may round to the farther neighbour outside the tie band: an
#: honest round-to-nearest has none (reciprocal products stay inside the band); 0.1% leaves
#: room for a few flips at the band's edge; truncation flips 40-50%.
ROUNDING_OFF_BY_ONE_SHARE = 1e-3
#: The mean signed error beyond round to nearest's own on the same values (q minus the nearest
#: grid point, in steps, averaged overall and toward zero; 0 within the tie band, so data full
#: of exact ties does not bias an honest tie rule) may be at most a twentieth of a step: honest
#: kernels leave the nearest point only at ties; truncation biases by about half a step toward
#: zero, 10x this limit.
ROUNDING_BIAS_LIMIT = 0.05
#: The fields of a rounding rule an ``[[tool.numalign.override]]`` entry may set.
ROUNDING_KEYS: tuple[str, ...] = ("tie_band", "max_step_error", "off_by_one_share", "bias_limit")

#: Logits: a top-1 or top-5 difference is explained (a near tie) where the golden logits of
#: the two tokens lie within NEAR_TIE_MULTIPLIER times the logits' max-abs budget: each of the
#: two logits may move by the whole budget, one up and one down. The greedy continuation's
#: first differing token is allowed the same gap.
NEAR_TIE_MULTIPLIER = 2.0
#: The logits' KL budget: KL_SPREAD_POWER, because a KL divergence is quadratic in small logit
#: differences, so an error the relative L2 spread s allows moves it by s**2 times the
#: control's KL; plus a rounding floor of KL_ROUNDING_FLOOR ulp**2 (two roundings of every
#: logit differ by at most 2 * ulp / 2, and a KL is half the squared difference: (ulp)**2 / 2);
#: plus the KL's own float64 evaluation, a sum over the vocabulary of p * (log p - log q)
#: terms whose roundings reach about KL_EVALUATION_ROUNDOFF (eps of float64) times the entropy
#: (at most log(vocab)) plus one.
KL_SPREAD_POWER = 2.0
KL_ROUNDING_FLOOR = 0.5
KL_EVALUATION_ROUNDOFF = 2.0**-52

#: A baseline diff does not report growth below this use of the budget: 0.001 -> 0.004 of a
#: budget is noise of the last bits, not a trend (``report.baseline``).
NOISE_FLOOR = 0.05

#: A swap's adapter check (``replay.swap``): the operator's float32 reference through the
#: adapter must reproduce the module on a probe input within SWAP_PROBE_EPS eps of the
#: module's dtype, relative and absolute: the module rounds to its dtype a few times more than
#: the float32 reference (a product, a sum, a scale: about one eps each, four with margin).
SWAP_PROBE_EPS = 4.0


# -- the model verdict (``compare.calibration``, ``compare.model_verdict``) ---------------------
#: The 16-bit calibrations a finer dtype (float32, float64) borrows, closest first: a float16
#: kernel (float32 accumulation, one rounding) errs by about one float16 rounding, so the
#: closest calibrated 16-bit dtype, scaled, bounds what a finer kernel may err.
BORROWED_CALIBRATIONS: tuple[str, ...] = ("float16", "bfloat16")
#: The exponent of the reduction length in the borrowing scale s = u_fine / u_16 * K**this: a
#: kernel of the finer dtype that sums a reduction of length K in another order (a fused norm,
#: other threads, another device) errs by up to sqrt(K) of its own roundings [walk].
BORROWED_REDUCTION_WALK = 0.5
#: Roundings (ulps of the output's largest magnitude) that a rounded sum of addends of that
#: size may lose to cancellation: where the reference lies within the control's worst error
#: plus this many, an honest candidate may land exactly on zero (``a + b == 0`` in bfloat16).
ZERO_REACH_ROUNDINGS = 1.0


#: A decode cache the capture probes beside the reference's (``golden.decode``) whose step
#: logits differ from the reference cache's by more than this share of their largest is
#: written into the set as a limit of the model's code: another cache reorders float32 sums
#: (about 1e-6 of the logits), a cache the model's code mishandles moves them by percents
#: (GIT's static decode: its encoder layers 2% off).
CACHE_LIMIT_DISAGREEMENT = 1e-3
#: Against a baseline, a record regresses when its budget use grows beyond this factor of
#: the baseline's (``report.baseline``): twice the error is beyond the run-to-run noise of
#: deterministic inputs, well before a failure.
REGRESSION_FACTOR = 2.0
#: Against a baseline, a budget limit or power figure grown beyond this factor is listed as
#: loosened or weakened (``report.ratchet``). 1.5 is above every honest move between AVX2
#: and AVX-512 kernels: calibrated budgets do not move, power moves by the candidate's own
#: lean's standard error (up to 1.085x), a budget from a control run on the machine up to
#: 1.33x (a top-k whose control chose otherwise at a tie) (docs/ci.md).
RATCHET_FACTOR = 1.5


@dataclass(frozen=True)
class Thresholds:
    """The thresholds that do not depend on an operator or point name, each overridable in
    ``[tool.numalign.thresholds]`` of pyproject.toml (the constants above give the defaults
    and their reasons): the logits' near tie and KL budget, the baseline diff's noise floor
    (read by the session's report and ``numalign report``), the model verdict's zero reach
    and borrowing walk, the lean rule's z-score, spread and floor, and the routing's flips'
    z-score. A policy carries them (``TolerancePolicy.thresholds``) to every verdict it
    reaches. SWAP_PROBE_EPS is not among them: it checks numalign's own adapter against the
    module it stands for, not a candidate, and loosening it would only hide an adapter that
    tests the wrong thing."""

    near_tie_multiplier: float = NEAR_TIE_MULTIPLIER
    kl_spread_power: float = KL_SPREAD_POWER
    kl_rounding_floor: float = KL_ROUNDING_FLOOR
    kl_evaluation_roundoff: float = KL_EVALUATION_ROUNDOFF
    noise_floor: float = NOISE_FLOOR
    zero_reach_roundings: float = ZERO_REACH_ROUNDINGS
    borrowed_reduction_walk: float = BORROWED_REDUCTION_WALK
    lean_z: float = LEAN_Z
    lean_spread: float = LEAN_SPREAD
    lean_floor_roundoffs: float = LEAN_FLOOR_ROUNDOFFS
    flip_z: float = FLIP_Z


def parse_threshold(value: Any, where: str) -> float:
    """A threshold read from pyproject: a number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: expected a number, got {value!r}")
    number = float(value)
    if not number >= 0:  # NaN too
        raise ValueError(f"{where}: expected a number >= 0, got {value!r}")
    return number


def thresholds_from_table(table: Mapping[str, Any], where: str) -> Thresholds:
    """``[tool.numalign.thresholds]`` as ``Thresholds`` (unknown keys are errors)."""
    known = [f.name for f in fields(Thresholds)]
    unknown = sorted(set(table) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {known}")
    return Thresholds(**{k: parse_threshold(v, f"{where}: {k}") for k, v in table.items()})
