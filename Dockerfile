# One image for tuner workers and the dashboard (see docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
# PyTorch first, inside the range the project supports; a GPU host gets the CUDA build it needs.
RUN pip install --no-cache-dir "torch>=2.5,<2.15"
COPY pyproject.toml README.md ./
COPY engine engine
COPY workloads workloads
COPY tuner tuner
COPY db db
COPY dashboard dashboard
RUN pip install --no-cache-dir ".[postgres]"
ENV MOETUNE_CACHE=/cache
VOLUME ["/cache"]
