# envace CPU image: resolve_config, curate, register (same content as tasks/images.py CPU_IMAGE).
# Build from the repository root:  docker build -f containers/cpu.Dockerfile -t REGISTRY/envace-cpu:TAG .
ARG BASE_IMAGE=debian:bookworm-slim
FROM ghcr.io/astral-sh/uv:0.5.1 AS uv
FROM ${BASE_IMAGE}
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH \
    UV_COMPILE_BYTECODE=1 UV_LINK_MODE=copy PYTHONPATH=/root
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* && uv venv --python 3.11 /opt/venv
WORKDIR /root
# Dependencies first (from pyproject.toml; torch as the CPU-only wheel), so code changes reuse this layer.
COPY pyproject.toml README.md ./
COPY tasks/image_requirements.py tasks/image_requirements.py
RUN python tasks/image_requirements.py cpu > /tmp/requirements.txt \
    && uv pip install --extra-index-url https://download.pytorch.org/whl/cpu \
       --index-strategy unsafe-best-match -r /tmp/requirements.txt
COPY envace_core envace_core
RUN uv pip install --no-deps . && uv pip install --no-deps $(python tasks/image_requirements.py cpu --no-deps)
# The Flyte tasks and workflows, for registration without fast-register (pyflyte register --copy none).
COPY tasks tasks
COPY workflows workflows
# The DVC repository's config (its remotes), so curate versions the data in a pod without .git.
COPY .dvc/config .dvc/config
# The commit the sources come from, for the lineage of runs in this image (envace_core/buildinfo.py):
#   --build-arg COMMIT=$(git rev-parse HEAD) --build-arg SOURCE_DATE=$(git show -s --format=%cI HEAD)
ARG COMMIT=""
ARG SOURCE_DATE=""
RUN if [ -n "$COMMIT" ]; then printf '{"commit": "%s", "source_date": "%s"}\n' "$COMMIT" "$SOURCE_DATE" \
        > /root/envace_core/BUILD_INFO.json; fi
