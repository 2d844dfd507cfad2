"""Parameter importance (Optuna's evaluators), shown only where the trials differ beyond noise.

PED-ANOVA ranks the knobs by how much each decides whether a trial lands among the best. On a
machine where every trial's value lies within the run-to-run noise, any ranking is noise too: the
verdict then says so instead (``tuner.stats.within_noise``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

log = logging.getLogger(__name__)

DEFAULT_QUANTILE = 0.1  # Optuna's
TOP_TRIALS = 4


def param_importance(study: Any, objective_index: int = 0, direction: str = "maximize") -> dict[str, Any]:
    """PED-ANOVA importances of one objective over the complete trials of an Optuna study.

    Returns ``{"importances": {knob: share}, "n_trials": n}`` or ``{"message": why not}``.
    """
    from optuna.importance import PedAnovaImportanceEvaluator, get_param_importances
    from optuna.trial import TrialState

    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(done) < 2:
        return {"message": f"needs at least 2 complete trials; the study has {len(done)}"}
    sign = -1.0 if direction == "maximize" else 1.0  # PED-ANOVA ranks low target values as good

    def target(t: Any) -> float:
        return sign * t.values[objective_index]

    # PED-ANOVA compares the best ``target_quantile`` of the trials with all of them; Optuna's 10 % is one
    # trial in a short study, which any knob can "explain". At least TOP_TRIALS form the best group.
    quantile = min(0.5, max(DEFAULT_QUANTILE, TOP_TRIALS / len(done)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imp = get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(target_quantile=quantile),
                                        target=target)
    except (ValueError, RuntimeError, ZeroDivisionError) as e:
        return {"message": f"could not be computed: {' '.join(str(e).split())[:200]}"}
    return {"importances": {k: float(v) for k, v in imp.items()}, "n_trials": len(done), "top_quantile": quantile}


def verdict(imp: Mapping[str, Any], within_noise: bool | None, noise: Mapping[str, Any] | None) -> dict[str, Any]:
    """Importances with the noise beside them, or the reason there is no ranking."""
    spread = f"{noise['rel_spread']:.1%}" if noise else "not measured"
    if within_noise:
        return {"ranked": False, "noise_rel_spread": noise["rel_spread"] if noise else None,
                "message": f"the complete trials' values spread no wider than the noise (run-to-run spread "
                           f"{spread} over {noise['n'] if noise else 0} runs of the defaults): no knob ranking "
                           "means anything here"}
    if "importances" not in imp:
        return {"ranked": False, "message": imp.get("message", "not computed")}
    top = sorted(imp["importances"].items(), key=lambda kv: -kv[1])
    listed = ", ".join(f"{k} {v:.2f}" for k, v in top[:4])
    return {"ranked": True, "importances": dict(top), "n_trials": imp["n_trials"],
            "noise_rel_spread": noise["rel_spread"] if noise else None,
            "message": f"{listed} (PED-ANOVA over {imp['n_trials']} complete trials; noise {spread})"}


def importance_report(url: str, report: Mapping[str, Any]) -> dict[str, Any] | None:
    """:func:`verdict` for the study of a ``study_report`` in the database at ``url`` (single objective)."""
    import optuna

    if len(report["objectives"]) != 1:
        return None
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        storage = optuna.storages.RDBStorage(url, skip_table_creation=True)
        study = optuna.load_study(study_name=report["study"], storage=storage)
    except Exception as e:  # noqa: BLE001 - Optuna and SQLAlchemy raise many kinds
        # Said where the ranking would be, not only in a log.
        return {"ranked": False, "message": "not computed: cannot open the Optuna study ("
                + " ".join(str(e).split())[:160] + ")"}
    imp = param_importance(study, 0, report["directions"][0])
    return verdict(imp, report.get("within_noise"), report.get("noise"))
