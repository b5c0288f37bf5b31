"""Which packages the distribution carries; everything else is in pyproject.toml.

The Alembic migrations live at the repository's top level (`migrations/`) and ship inside the
package as `daemon.migrations`, so a wheel install migrates from any folder.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["daemon", "daemon.*"]), "daemon.migrations", "daemon.migrations.versions"],
    package_dir={"daemon.migrations": "migrations"},
)
