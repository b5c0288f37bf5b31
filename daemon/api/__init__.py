"""The daemon's HTTP API: one FastAPI app on the control listener.

    app               the app, status and metrics routes, the listener (ApiServer), rollout
                      control routes (`/v1/rollout/...`)
    broadcast         `POST /v1/broadcast...`: a trainer's torch.distributed session, parsed and
                      authenticated here, driven by daemon.controller.broadcast
    readiness         `/ready`: does this host serve
    reverify          `POST /v1/checkpoints/reverify`
    registry_metrics  the Prometheus series read from the registry at scrape time

Above the pipeline and the controller (it calls into both); below `daemon.service`, which builds
it. The push source's listener is a source (daemon.sources.push), not part of this app.
"""
