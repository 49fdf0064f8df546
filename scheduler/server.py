"""Run the scheduler under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import uvicorn

from scheduler.app import create_app
from scheduler.read_deadline import read_deadline_protocol
from scheduler.state import SchedulerState
from symphony.config import SymphonyConfig
from symphony.logs import get_logger

log = get_logger(__name__)


def server_config(config: SymphonyConfig, state: SchedulerState) -> uvicorn.Config:
    """uvicorn's settings for the scheduler of `config` (each request read within its deadline,
    idle connections kept for `scheduler.keep_alive_s`)."""
    return uvicorn.Config(
        create_app(config, state),
        http=read_deadline_protocol(config.scheduler.request_read_timeout_s, state.metrics.read_timeouts.inc),
        host=config.scheduler.host,
        port=config.scheduler_listen_port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=config.scheduler.keep_alive_s,
        timeout_graceful_shutdown=5,
    )


def serve(config: SymphonyConfig) -> None:
    server = uvicorn.Server(server_config(config, SchedulerState(config)))
    log.info(
        "scheduler listening",
        url=f"http://{config.scheduler.host}:{config.scheduler_listen_port}",
        region=config.scheduler.region or "-",
        nodes=",".join(config.scheduler_node_addresses()),
        policy=config.scheduler.policy,
    )
    server.run()
