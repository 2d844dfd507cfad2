"""A short study on PostgreSQL: the same tables, Optuna's storage beside them, resumable."""

from __future__ import annotations

import optuna
from sqlalchemy import select

from db.models import RequestRow, Study, Trial
from db.session import make_engine, session_scope
from db.testing import create_database
from tuner.cli import main


def test_study_on_postgresql(pg_server, capsys, kit):
    url = create_database(pg_server)
    args = ["run", *kit.FAST[:-1], "4", "--trials", "2", "--db", url, "--study", "pg", "--quiet"]
    assert main(args) == 0, capsys.readouterr().err
    db = make_engine(url)
    with session_scope(db) as s:
        name = s.scalars(select(Study.name)).one()
        trials = s.scalars(select(Trial).order_by(Trial.number)).all()
        assert [t.state for t in trials] == ["complete", "complete"]
        assert s.scalars(select(RequestRow.met_slo).where(RequestRow.trial_id == trials[0].id)).all()
    optuna_study = optuna.load_study(study_name=name, storage=url)
    assert len(optuna_study.trials) == 2  # the third baseline waits for a run with room for it
    assert main([*args[:args.index("--trials") + 1], "3", *args[args.index("--trials") + 2:]]) == 0  # resume
    assert len(optuna.load_study(study_name=name, storage=url).trials) == 3
    assert main(["show", "--study", "pg", "--db", url]) == 0
    assert "finding: " in capsys.readouterr().out
    db.dispose()
