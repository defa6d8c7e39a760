# One image for every sked service: the command picks the service (compose.yaml), e.g.
#   docker run --rm sked:latest service executor --slots 4
#   docker run --rm sked:latest migrate

# -- build: install sked and its dependencies into a virtualenv ------------------------------
FROM python:3.11-slim AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/sked/bin:$PATH
RUN python -m venv /opt/sked

WORKDIR /src
# Only what the package build reads: pyproject.toml (its readme is README.md) and the two
# packages; the SQL migrations are package data inside shared/.
COPY pyproject.toml README.md ./
COPY shared/ shared/
COPY services/ services/
COPY sked/ sked/
RUN pip install --no-cache-dir .

# -- run: the virtualenv on a clean base, as a non-root user ---------------------------------
FROM python:3.11-slim

ENV PATH=/opt/sked/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

# libpq: `sked status` reads through it (shared/store/libpq.py), sparing asyncio's imports
RUN apt-get update \
    && apt-get install -y --no-install-recommends libpq5 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 sked \
    && useradd --system --uid 10001 --gid sked --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin sked \
    && mkdir /app \
    && chown sked:sked /app

COPY --from=build /opt/sked /opt/sked

WORKDIR /app
USER sked

ENTRYPOINT ["sked"]
CMD ["--help"]
