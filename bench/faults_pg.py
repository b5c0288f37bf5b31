"""A throw-away PostgreSQL 15 cluster for the fault matrix (never the shared server on 5432).

    pg = PgCluster(Path("/tmp/hs-pg"), port=55432).init(); pg.start()
    url = pg.create_database("hotswap")   # postgresql+psycopg://postgres@127.0.0.1:55432/hotswap
    pg.stop(); pg.start(); pg.destroy()

initdb and pg_ctl run as the `postgres` OS user (runuser), trust auth on loopback.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

BIN = Path("/usr/lib/postgresql/15/bin")


class PgCluster:
    def __init__(self, root: Path, port: int) -> None:
        self.root, self.port = root, port
        self.data = root / "data"

    def _as_postgres(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], capture_output=True, text=True, check=check)

    def init(self) -> PgCluster:
        self.root.mkdir(parents=True, exist_ok=True)
        shutil.chown(self.root, "postgres", "postgres")
        self._as_postgres(str(BIN / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres")
        return self

    def start(self) -> None:
        self._as_postgres(str(BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w",
                          "-o", f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1", "start")  # fmt: skip

    def stop(self) -> None:
        self._as_postgres(str(BIN / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def url(self, database: str) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        from sqlalchemy import create_engine, text

        admin = create_engine(self.url("postgres"), isolation_level="AUTOCOMMIT")
        with admin.connect() as c:
            c.execute(text(f'CREATE DATABASE "{name}"'))
        admin.dispose()
        return self.url(name)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)
