# Conveyor on CPU: `conveyor serve` of the built-in model, or of a model directory mounted into the container.
#   docker build -t conveyor:cpu .
#   docker run -p 8000:8000 conveyor:cpu                                    # the built-in SmolLM2-135M-Instruct
#   docker run -p 8000:8000 -v /models/qwen:/models/qwen conveyor:cpu /models/qwen --max-model-len 8192
# The image is built by the README's setup (scripts/setup.sh, which CI runs on a clean clone); see docs/operating.md.
FROM python:3.12-slim

# A C++ compiler for the native CPU kernels: built at image build, again at start on another CPU.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 conveyor && install -d -o conveyor /opt/conveyor
USER conveyor
WORKDIR /opt/conveyor
COPY --chown=conveyor pyproject.toml README.md ./
COPY --chown=conveyor scripts ./scripts
COPY --chown=conveyor conveyor ./conveyor

# The README's setup: the venv, Conveyor, the built-in model, the kernels. PyTorch's CPU wheel index is
# searched too, so that torch is the CPU build rather than PyPI's CUDA one (several GB).
RUN PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu scripts/setup.sh
# Optional extras (pyproject.toml), e.g. `--build-arg EXTRAS=otel` for --otlp-traces-endpoint.
ARG EXTRAS=""
RUN if [ -n "$EXTRAS" ]; then .venv/bin/python -m pip install --quiet -e ".[$EXTRAS]"; fi

ENV PATH=/opt/conveyor/.venv/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 8000
HEALTHCHECK --start-period=120s CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
ENTRYPOINT ["conveyor", "serve", "--host", "0.0.0.0", "--port", "8000"]
