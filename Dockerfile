# The project image. Every lig service runs from it, chosen by its command (`picker --pool ...`,
# `collector`, `registry PATH`, `sim ...`); see deploy/compose.yaml and deploy/kubernetes/.
# NATS and Envoy run from their official images: their binaries (the `[local]` extra, for
# `lig up`) are not installed in this one.
#
#   docker build -t llm-instance-gateway .
#   docker run --rm llm-instance-gateway picker --help

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/lig
# Dependencies first, in their own layer, so that a source change does not reinstall them.
COPY pyproject.toml README.md /src/
RUN python -c "import tomllib; project = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; \
    print(*project['dependencies'], sep='\n')" > /tmp/requirements.txt
RUN /opt/lig/bin/pip install -r /tmp/requirements.txt
COPY . /src
RUN /opt/lig/bin/pip install --no-deps /src

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin lig
COPY --from=build /opt/lig /opt/lig
ENV PATH=/opt/lig/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /tmp
ENTRYPOINT ["lig"]
CMD ["--help"]
