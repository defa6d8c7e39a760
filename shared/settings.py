"""Configuration from `SKED_*` environment variables: the only place that reads the environment.

One set of variables points a whole deployment (or one test) at its own Postgres database,
Redis database and RabbitMQ vhost; every process reads them through `Settings`.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SKED_", extra="ignore")

    database_url: str = "postgresql://postgres@127.0.0.1:5432/sked"
    redis_url: str = "redis://127.0.0.1:6379/0"
    rabbitmq_url: str = "amqp://guest:guest@127.0.0.1:5672/"

    db_pool_size: int = Field(default=8, ge=1, le=200)
    log_level: str = "INFO"
    log_json: bool = False

    # Outbox relay: the largest batch read per pass, and the safety sweep period that catches
    # events whose NOTIFY was missed (a listener reconnect, a relay crash).
    relay_batch: int = Field(default=1000, ge=1, le=10_000)
    relay_sweep_s: float = Field(default=5.0, gt=0)
