"""Cascade verifier: keep the small tier's answer, or escalate to the large tier.

Cascade mode runs the small tier first, then asks this verifier whether its answer is weak.

Signals (``CASCADE_FEATURES``), all cheap, computed from the small answer and the request:

* ``no_final_answer``: the answer never states a final answer (``#### 42``, "the answer is 42",
  "Answer: B", ``\\boxed{42}``);
* ``arithmetic_errors``: calculator annotations (``<<3*60=180>>``) and inline arithmetic
  (``3 x 60 = 180``) that do not compute, re-evaluated by a small safe evaluator;
* ``non_integer_final``: the final answer is a number with a fraction part;
* ``text_after_final``: the answer goes on after its final answer (second thoughts);
* ``hedges``: hedging and self-correction phrases ("however", "actually", "assume", ...);
* ``log_words``: the length of the answer;
* ``difficulty``: the request's difficulty score (``routing.difficulty``);
* ``mean_logprob`` / ``min_logprob``: the small model's token logprobs, when the engine returned
  them (vLLM does with ``logprobs: true``). They enter the combiner only when the training data
  carried them (a ``small_logprobs`` list per row); the shipped artifact was trained on the
  GSM8K dev answers, which have none, so it ignores them.

A truncated answer (``finish_reason == "length"``) or an empty one always escalates, except a
cut the caller's own ``max_tokens`` made (the large tier would be cut there too). A tool call is
an answer, never an empty one: the text signals say nothing of it and are unknown (set to their
training mean, as at a commit point), so difficulty and logprobs judge it. Otherwise a
learned combiner (two L2-regularised logistic regressions over the standardised signals, as in
``routing.difficulty``) estimates the gain of the large tier, ``P(large correct) - P(small
correct)``, and the answer escalates iff that gain reaches the threshold. The reason names the
signal that pushed hardest towards "the small answer is wrong". The text signals are made for
answers with a checkable final result (math, multiple choice); on free-form chat they say little.

Streaming and the commit point. With ``stream: true`` the client must never see a token that an
escalation would take back, so the gateway holds the small tier's output until a commit point
(``commit`` in the tier policy), runs the verifier there, and then either releases the held
chunks and relays the rest of the small stream, or drops them and streams the large tier only:

* ``commit: {tokens: whole}`` (the default): hold the whole small answer; the verifier sees every
  signal. The client's TTFT becomes the small tier's full generation time (plus, on escalation,
  the large tier's TTFT): the price of never retracting text.
* ``commit: {tokens: N}``: judge the first N tokens, then stream. TTFT is the time to N tokens;
  signals that need the whole answer (final answer, length) are unknown there and are set to
  their training mean (``SmallAnswer(complete=False)``), so the verdict leans on the logprobs,
  arithmetic seen so far, hedges and difficulty. Past the commit point the small answer stands.

If the large tier then fails, the gateway falls back to the small answer read whole and says
so (a small stream held to N tokens was closed at the verdict: the failure is the answer).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from policies.models import CalibrationTarget
from routing.calibration import CalibrationTable, wants_large
from routing.difficulty import LogisticHead, compact

FloatArray = npt.NDArray[np.float64]

CASCADE_FEATURES: tuple[str, ...] = (
    "no_final_answer",
    "arithmetic_errors",
    "non_integer_final",
    "text_after_final",
    "hedges",
    "log_words",
    "difficulty",
    "mean_logprob",
    "min_logprob",
)
LOGPROB_FEATURES = frozenset({"mean_logprob", "min_logprob"})
# Unknown before the answer is complete (a commit point of N tokens).
NEEDS_COMPLETE_ANSWER = frozenset(
    {"no_final_answer", "non_integer_final", "text_after_final", "log_words"}
)
# Read from the answer's text: unknown for an answer that is only tool calls.
TEXT_FEATURES = frozenset(CASCADE_FEATURES) - {"difficulty"} - LOGPROB_FEATURES

REASONS = {
    "no_final_answer": "no clear final answer",
    "arithmetic_errors": "arithmetic that does not compute",
    "non_integer_final": "final answer is not a whole number",
    "text_after_final": "answer continues after its final answer",
    "hedges": "hedging or self-correction",
    "log_words": "answer length",
    "difficulty": "difficult request",
    "mean_logprob": "low mean token logprob",
    "min_logprob": "a very unlikely token",
}

_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_FINAL_PATTERNS = (
    re.compile(r"####\s*\$?\s*(" + _NUM + r")?"),
    re.compile(r"\\boxed\{\s*\$?(" + _NUM + r")?[^}]*\}"),
    re.compile(
        r"(?:final answer|the answer is|answer:)\s*(?:is\s*)?[:=]?\s*\$?\s*(" + _NUM + r")?",
        re.IGNORECASE,
    ),
)
_CALC = re.compile(r"<<([^<>=]{1,200})=([^<>]{1,60})>>")
_ANNOTATED = re.compile(r"=?\s*\$?\s*<<[^<>]*>>")
_INLINE = re.compile(
    r"((?:\d[\d,]*(?:\.\d+)?\s*[-+x\u00d7*/\u00f7]\s*)+\d[\d,]*(?:\.\d+)?)\s*=\s*\$?\s*("
    + _NUM
    + r")"
)
_HEDGE = re.compile(
    r"\b(however|actually|assum\w*|approximately|not possible|cannot|can't|round\w*|unclear|"
    r"but since|wait|mistake|incorrect|sorry|i think|maybe|perhaps|not enough|impossible)\b",
    re.IGNORECASE,
)

_BINARY: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _evaluate(node: ast.AST) -> float:
    """Arithmetic on numeric literals only; anything else raises ValueError."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 12 or abs(left) > 1e6):
            raise ValueError("power too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError("not arithmetic")


def _parse_number(text: str) -> float:
    return float(text.strip().replace(",", "").replace("$", "").rstrip("."))


def _arithmetic_is_wrong(expression: str, result: str) -> bool | None:
    """True/False when the expression could be checked, None when it could not."""
    cleaned = (
        expression.replace("\u00d7", "*")
        .replace("x", "*")
        .replace("\u00f7", "/")
        .replace(",", "")
        .replace("$", "")
        .replace("%", "/100")
    )
    try:
        value = _evaluate(ast.parse(cleaned.strip(), mode="eval"))
        claimed = _parse_number(result)
    except (ValueError, SyntaxError, ZeroDivisionError, OverflowError):
        return None
    decimals = len(result.strip().rstrip(".").partition(".")[2])
    # A rounded result ("10/3 = 3.33") is right; so is anything within relative 1e-6.
    tolerance = max(0.5 * 10.0**-decimals if decimals else 1e-6, 1e-6 * abs(value))
    return abs(value - claimed) > tolerance


def count_arithmetic_errors(text: str) -> int:
    errors = 0
    for expression, result in _CALC.findall(text):
        errors += _arithmetic_is_wrong(expression, result) is True
    # "3 x 60 = <<3*60=180>>180" states one computation: check it once, as the annotation.
    for expression, result in _INLINE.findall(_ANNOTATED.sub(" ", text)):
        errors += _arithmetic_is_wrong(expression, result) is True
    return errors


def final_answer(text: str) -> tuple[str | None, str]:
    """``(number or "" when the final answer is not a number, text after it)``; None: no answer."""
    for pattern in _FINAL_PATTERNS:
        matches = list(pattern.finditer(text))
        if matches:
            last = matches[-1]
            return (last.group(1) or ""), text[last.end() :].strip()
    return None, ""


@dataclass(frozen=True)
class SmallAnswer:
    text: str
    token_logprobs: Sequence[float] | None = None
    finish_reason: str | None = None
    complete: bool = True  # False when judged at a commit point before the end
    tool_calls: int = 0  # the tool calls it makes (an answer even without text)
    callers_limit: bool = False  # a "length" finish is the caller's own max_tokens


def answer_signals(answer: SmallAnswer, difficulty: float) -> dict[str, float]:
    """Raw signal values in ``CASCADE_FEATURES`` order; NaN marks an unknown signal."""
    text = answer.text
    number, after = final_answer(text)
    non_integer = 0.0
    if number:
        try:
            value = _parse_number(number)
            non_integer = float(abs(value - round(value)) > 1e-9)
        except ValueError:
            non_integer = 0.0
    logprobs = [float(v) for v in answer.token_logprobs or () if math.isfinite(v)]
    signals = {
        "no_final_answer": float(number is None),
        "arithmetic_errors": math.log1p(count_arithmetic_errors(text)),
        "non_integer_final": non_integer,
        "text_after_final": float(bool(after)),
        "hedges": math.log1p(len(_HEDGE.findall(text))),
        "log_words": math.log1p(len(text.split())),
        "difficulty": float(difficulty),
        "mean_logprob": float(np.mean(logprobs)) if logprobs else math.nan,
        "min_logprob": float(np.min(logprobs)) if logprobs else math.nan,
    }
    unknown = set() if answer.complete else set(NEEDS_COMPLETE_ANSWER)
    if answer.tool_calls and not text.strip():
        unknown |= TEXT_FEATURES
    for name in unknown:
        signals[name] = math.nan
    return signals


@dataclass(frozen=True)
class CascadeVerdict:
    escalate: bool
    score: float  # estimated gain of the large tier
    threshold: float
    reason: str
    signals: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class CascadeVerifier:
    features: tuple[str, ...]
    feature_mean: FloatArray
    feature_scale: FloatArray
    small: LogisticHead
    large: LogisticHead
    threshold: float
    calibration: CalibrationTable | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def design(
        self, answers: Sequence[SmallAnswer], difficulty: Sequence[float] | FloatArray
    ) -> FloatArray:
        if len(answers) != len(difficulty):
            raise ValueError("one difficulty score per answer")
        signals = [answer_signals(a, d) for a, d in zip(answers, difficulty, strict=True)]
        raw = np.array(
            [[s[name] for name in self.features] for s in signals], dtype=np.float64
        ).reshape(len(answers), len(self.features))
        standard = (raw - self.feature_mean) / self.feature_scale
        result: FloatArray = np.where(np.isnan(standard), 0.0, standard)  # unknown -> mean
        return result

    def score_batch(
        self, answers: Sequence[SmallAnswer], difficulty: Sequence[float] | FloatArray
    ) -> FloatArray:
        return self._scores(self.design(answers, difficulty), answers)

    def _scores(self, design: FloatArray, answers: Sequence[SmallAnswer]) -> FloatArray:
        scores = self.large.probability(design) - self.small.probability(design)
        forced = np.array([_forced_reason(a) is not None for a in answers], dtype=bool)
        result: FloatArray = np.where(forced, 1.0, scores)
        return result

    def verdict_batch(
        self,
        answers: Sequence[SmallAnswer],
        difficulty: Sequence[float] | FloatArray,
        threshold: float | None = None,
    ) -> list[CascadeVerdict]:
        limit = self.threshold if threshold is None else threshold
        design = self.design(answers, difficulty)
        scores = self._scores(design, answers)
        escalate = wants_large(scores, limit)
        verdicts = []
        for i, answer in enumerate(answers):
            forced = _forced_reason(answer)
            if forced is not None:
                reason = f"escalate: {forced}"
            elif escalate[i]:
                # The signal pulling P(small correct) down the most.
                pull = self.small.coef[: len(self.features)] * design[i]
                reason = f"escalate: {REASONS[self.features[int(np.argmin(pull))]]}"
            else:
                reason = "keep: no strong sign of a wrong answer"
            signals = dict(zip(self.features, design[i].tolist(), strict=True))
            verdicts.append(
                CascadeVerdict(bool(escalate[i]), float(scores[i]), limit, reason, signals)
            )
        return verdicts

    def verdict(
        self, answer: SmallAnswer, difficulty: float, threshold: float | None = None
    ) -> CascadeVerdict:
        return self.verdict_batch([answer], [difficulty], threshold)[0]

    def threshold_for(self, target: CalibrationTarget) -> float:
        if self.calibration is None:
            raise ValueError("this artifact carries no cascade calibration: give a threshold")
        return self.calibration.threshold_for(target)

    def to_json(self) -> dict[str, Any]:
        return {
            "score": "P(large correct) - P(small correct), given the small answer",
            "features": list(self.features),
            "feature_mean": compact(self.feature_mean),
            "feature_scale": compact(self.feature_scale),
            "small": self.small.to_json(),
            "large": self.large.to_json(),
            "threshold": self.threshold,
            "calibration": self.calibration.to_json() if self.calibration else None,
            "info": self.info,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CascadeVerifier:
        features = tuple(str(f) for f in data["features"])
        unknown = set(features) - set(CASCADE_FEATURES)
        if unknown:
            raise ValueError(f"unknown cascade features: {sorted(unknown)}")
        width = len(features)
        scale = np.asarray(data["feature_scale"], dtype=np.float64)
        if scale.shape != (width,) or np.any(scale <= 0):
            raise ValueError("feature_scale must hold one positive value per feature")
        table = data.get("calibration")
        return cls(
            features=features,
            feature_mean=np.asarray(data["feature_mean"], dtype=np.float64).reshape(width),
            feature_scale=scale,
            small=LogisticHead.from_json(data["small"], width),
            large=LogisticHead.from_json(data["large"], width),
            threshold=float(data["threshold"]),
            calibration=CalibrationTable.from_json(table) if table else None,
            info=dict(data.get("info", {})),
        )


def _forced_reason(answer: SmallAnswer) -> str | None:
    if answer.complete and answer.finish_reason == "length" and not answer.callers_limit:
        return "answer truncated (finish_reason=length)"
    if answer.complete and not answer.text.strip() and not answer.tool_calls:
        return "empty answer"
    return None


def load_verifier(path: Any = None) -> CascadeVerifier:
    """The cascade verifier of an artifact (default: the one shipped in the package)."""
    from routing.difficulty import read_artifact

    data = read_artifact(path)
    if not data.get("cascade"):
        raise ValueError("this router artifact has no cascade verifier")
    return CascadeVerifier.from_json(data["cascade"])
