"""Run the scheduler under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import uvicorn

from scheduler.app import create_app
from symphony.config import SymphonyConfig
from symphony.logs import get_logger

log = get_logger(__name__)


def serve(config: SymphonyConfig) -> None:
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.scheduler.host,
            port=config.scheduler_listen_port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
    )
    log.info(
        "scheduler listening",
        url=f"http://{config.scheduler.host}:{config.scheduler_listen_port}",
        region=config.scheduler.region or "-",
        nodes=",".join(config.scheduler_node_addresses()),
        policy=config.scheduler.policy,
    )
    server.run()
