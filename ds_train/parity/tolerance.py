"""How `ds-train parity` judges a layout against the reference: relative differences (`rel`), a run's
per-step loss and gradient norm from its metrics (`series`), the tolerances (fp32's fixed ones, or
FLOOR_FACTOR x the noise floor measured in a low precision, the floor bounded by what rounding explains)
and the table with its verdict (`compare`).
"""

from __future__ import annotations

import math
from pathlib import Path

from ds_train.checkpoint.rundir import RunPaths, read_metrics

# Relative differences (loss, gradient norm) an fp32 layout may show against the fp32 reference: the
# two only sum in other orders (ZeRO-3's buckets, accumulation: ~1e-7).
FP32_TOLERANCES = (1e-5, 1e-4)
# bf16 / fp16 round every matmul input, so a layout in them differs from the fp32 reference by rounding
# alone. How much is measured each time: the reference's own layout run in that dtype (the noise floor);
# a layout may differ by FLOOR_FACTOR times it. (Measured on CPU, 8 steps, ZeRO 0-3 x 1-2 ranks x
# accumulation 1 and 4, Ulysses 2, AutoTP 2: every layout within 2.5x of the floor.)
FLOOR_FACTOR = 4
# An upper bound on the noise floor, relative, per dtype: (loss, gradient norm). A dtype's epsilon (2^-7 for
# bf16's 8-bit significand, 2^-10 for fp16's 11) is the gap between 1 and the next number it holds; one
# rounding moves a value by at most half of it. The loss is a mean over a step's tokens and the gradient
# norm a sum over every parameter, whose roundings have both signs and largely cancel: rounding alone
# leaves the loss far closer than one epsilon to fp32's (measured on this CPU over 5 steps: 2.1e-4, 0.03
# of bf16's epsilon; compiled against eager on an H200 over 10 steps: 1.9e-3, 0.24). The gradient norm
# carries the backward's roundings on top of the forward's and is dominated by its largest entries (less
# cancelling): measured 10x the loss's floor (2.1e-3, 0.27 epsilon), so it is given 4 epsilons. A floor
# past these is no rounding: the low-precision run computes something else (an update fp16's loss scale
# skipped on an overflow, a fault in that precision's path), and 4x it would let any layout pass.
FLOOR_BOUNDS = {"bf16": (2.0 ** -7, 4 * 2.0 ** -7), "fp16": (2.0 ** -10, 4 * 2.0 ** -10)}
# A mixture-of-experts model's routing (tokens per expert per layer, summed over ranks) against the
# reference's: the share of routing choices that may differ (a near tie in a router's scores can break
# the other way under another summation order; a wrong reduction moves a third or more).
ROUTER_TOLERANCE = 1e-3


def noise_floor(floor: dict, reference: dict) -> tuple[dict, dict]:
    """Per step, the largest relative differences so far (loss; gradient norm) between the reference's
    layout in a low precision and in fp32: what rounding alone has moved them by up to that step (it
    grows as the runs drift apart); "eval": the held-out loss, against the largest of all."""
    loss, grad, worst_loss, worst_grad = {}, {}, 0.0, 0.0
    for step, (ref_loss, ref_grad) in reference["steps"].items():
        got_loss, got_grad = floor["steps"].get(step, (None, None))
        worst_loss, worst_grad = max(worst_loss, rel(got_loss, ref_loss)), max(worst_grad, rel(got_grad, ref_grad))
        loss[step], grad[step] = worst_loss, worst_grad
    loss["eval"] = max(worst_loss, rel(floor["eval"], reference["eval"]))
    return loss, grad


def floor_problem(dtype: str, floor: tuple[dict, dict]) -> str | None:
    """Where the noise floor of `dtype` is past what rounding explains (FLOOR_BOUNDS), in words; None
    when it is within them."""
    past = []
    for what, series, bound in zip(("loss", "gradient norm"), floor, FLOOR_BOUNDS.get(dtype, (math.inf,) * 2)):
        worst = max(series, key=lambda k: series[k], default=None)
        if worst is not None and series[worst] > bound:
            where = "on the held-out loss" if worst == "eval" else f"at step {worst}"
            past.append(f"{what} {series[worst]:.1e} {where} (bound {bound:.1e})")
    return "; ".join(past) or None


def tolerances(dtype: str, floor: tuple[dict, dict] | None, loss_tol: float | None,
               grad_tol: float | None) -> tuple[float | dict, float | dict]:
    """(loss, gradient norm) tolerances of a layout in `dtype`: fp32's fixed ones, else per step
    FLOOR_FACTOR x the measured noise floor (never below fp32's, never above FLOOR_FACTOR x the
    dtype's FLOOR_BOUNDS: a broken low-precision run widens nothing); --loss-tol / --grad-tol replace either."""
    tol: tuple[float | dict, float | dict] = FP32_TOLERANCES
    if dtype != "fp32" and floor is not None:
        bounds = FLOOR_BOUNDS.get(dtype, (math.inf, math.inf))
        tol = tuple({k: max(FLOOR_FACTOR * min(v, bound), fixed) for k, v in series.items()}
                    for series, fixed, bound in zip(floor, FP32_TOLERANCES, bounds))
    return tol[0] if loss_tol is None else loss_tol, tol[1] if grad_tol is None else grad_tol


def rel(a: float | None, b: float | None) -> float:
    """|a - b| relative to |b|; infinite when either is missing or not finite."""
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)


def series(run_dir: Path) -> dict:
    """Per step (loss, grad norm) and the held-out loss after the last step, from a run's metrics."""
    records = {r["step"]: r for r in read_metrics(RunPaths(run_dir).metrics)}
    steps = {s: (r.get("train/loss"), r.get("optim/grad_norm")) for s, r in sorted(records.items())}
    last = records[max(records)] if records else {}
    router = {s: r["moe/tokens_per_expert"] for s, r in sorted(records.items()) if "moe/tokens_per_expert" in r}
    aux = {s: r["moe/aux_loss"] for s, r in sorted(records.items()) if "moe/aux_loss" in r}
    return {"steps": steps, "eval": last.get("eval/loss"), "router": router, "aux": aux}


def router_difference(layout: dict, reference: dict) -> tuple[float, int, int]:
    """The largest share of routing choices (tokens per expert, over layers) that differ from the
    reference's at a step, and at which step; how many steps the layout lacks the counts of."""
    worst, at, missing = 0.0, 0, 0
    for step, ref in reference.get("router", {}).items():
        got = layout.get("router", {}).get(step)
        if got is None or len(got) != len(ref) or any(len(a) != len(b) for a, b in zip(got, ref)):
            missing += 1
            continue
        moved = sum(abs(a - b) for row, ref_row in zip(got, ref) for a, b in zip(row, ref_row))
        share = moved / max(1, sum(map(sum, ref)) + sum(map(sum, got)))
        worst, at = max((worst, at), (share, step))
    return worst, at, missing


def compare(layout: dict, reference: dict, loss_tol: float | dict, grad_tol: float | dict) -> tuple[list[str], bool]:
    """The table of one layout against the reference, and whether every difference is within its
    tolerance (one for all steps, or one per step and "eval" for the held-out loss)."""
    def at(tol: float | dict, key) -> float:
        return tol[key] if isinstance(tol, dict) else tol

    lines = [f"  {'step':>5} {'loss':>13} {'reference':>13} {'rel diff':>9} {'grad norm':>11} "
             f"{'reference':>11} {'rel diff':>9}"]
    worst = {"loss": (-1.0, 0.0, 0.0, 1), "gradient-norm": (-1.0, 0.0, 0.0, 1)}  # (ratio, diff, tol, step)
    ok = len(layout["steps"]) == len(reference["steps"]) > 0
    for step, (ref_loss, ref_grad) in reference["steps"].items():
        loss, grad = layout["steps"].get(step, (None, None))
        dl, dg = rel(loss, ref_loss), rel(grad, ref_grad)
        for what, d, tol in (("loss", dl, at(loss_tol, step)), ("gradient-norm", dg, at(grad_tol, step))):
            worst[what] = max(worst[what], (d / tol, d, tol, step), key=lambda w: w[0])
        lines.append(f"  {step:>5} {_num(loss, 13)} {_num(ref_loss, 13)} {dl:>9.1e} {_num(grad, 11)} "
                     f"{_num(ref_grad, 11)} {dg:>9.1e}")
    de = rel(layout["eval"], reference["eval"])
    eval_tol = at(loss_tol, "eval")
    worst["loss"] = max(worst["loss"], (de / eval_tol, de, eval_tol, "eval"), key=lambda w: w[0])
    lines.append(f"  {'eval':>5} {_num(layout['eval'], 13)} {_num(reference['eval'], 13)} {de:>9.1e}")
    ok = ok and all(ratio <= 1 for ratio, *_ in worst.values())
    if reference.get("aux"):  # the router's auxiliary loss, held to the loss's tolerance
        diffs = {step: rel(layout.get("aux", {}).get(step), ref) for step, ref in reference["aux"].items()}
        _, d, tol, step = max((d / at(loss_tol, step), d, at(loss_tol, step), step) for step, d in diffs.items())
        ok = ok and d <= tol
        lines.append(f"  router aux loss: largest relative difference {d:.1e} at step {step} "
                     f"({'<=' if d <= tol else '>'} {tol:.2g})")
    if reference.get("router"):
        moved, step, missing = router_difference(layout, reference)
        ok = ok and moved <= ROUTER_TOLERANCE and not missing
        lines.append(f"  router: tokens per expert per layer, summed over ranks: "
                     + (f"missing at {missing} step(s); " if missing else "")
                     + f"largest share of routing choices off the reference's {moved:.1e}"
                     + (f" at step {step}" if moved else "")
                     + f" ({'<=' if moved <= ROUTER_TOLERANCE else '>'} {ROUTER_TOLERANCE:g})")
    said = [f"{what} difference {d:.1e} {'at step ' if step != 'eval' else 'on '}{step} "
            f"({'<=' if d <= tol else '>'} {tol:.2g})" for what, (_, d, tol, step) in worst.items()]
    lines.append(f"  {'PASS' if ok else 'FAIL'}: largest {', largest '.join(said)}")
    return lines, ok


def _num(value: float | None, width: int) -> str:
    return f"{value:>{width}.8g}" if isinstance(value, (int, float)) else f"{'-':>{width}}"
