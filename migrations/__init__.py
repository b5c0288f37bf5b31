"""Alembic migrations of the registry (shipped as the package daemon.migrations)."""
