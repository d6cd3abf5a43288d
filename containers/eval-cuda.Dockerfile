# envace CUDA evaluation image: validate, evaluate, rehearse (same content as tasks/images.py EVAL_IMAGE):
# the training image's packages plus bfcl-eval's data and checkers (installed --no-deps, as the Makefile does).
# Build from the repository root:  docker build -f containers/eval-cuda.Dockerfile -t REGISTRY/envace-eval-cuda:TAG .
ARG TRAIN_IMAGE=envace-train-cuda:latest
FROM ${TRAIN_IMAGE}
RUN uv pip install --no-deps $(python tasks/image_requirements.py eval-cuda --no-deps)
# The commit the sources come from, for the lineage of runs in this image (envace_core/buildinfo.py):
#   --build-arg COMMIT=$(git rev-parse HEAD) --build-arg SOURCE_DATE=$(git show -s --format=%cI HEAD)
ARG COMMIT=""
ARG SOURCE_DATE=""
RUN if [ -n "$COMMIT" ]; then printf '{"commit": "%s", "source_date": "%s"}\n' "$COMMIT" "$SOURCE_DATE" \
        > /root/envace_core/BUILD_INFO.json; fi
