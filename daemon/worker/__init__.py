"""Reference worker: model, scheduler, serving API, admin API (see daemon.worker.server)."""
