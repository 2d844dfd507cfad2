"""The results database: SQLAlchemy models, Alembic migrations, engines and the tuner's writes."""
