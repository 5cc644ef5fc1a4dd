# KVScope in a container that runs offline: DistilGPT-2 is downloaded and the built-in tiny model is
# trained while the image is built, so `docker run` needs no network.
#
#   docker build -t kvscope .
#   docker run --rm -p 8000:8000 kvscope        # then open http://127.0.0.1:8000
#
# Building needs the network (PyPI, the PyTorch CPU wheel index, the Hugging Face hub); running does not.
FROM python:3.11-slim

# HF_HOME: the Hugging Face cache (DistilGPT-2). KVSCOPE_HOME: KVScope's own files (built-in model, training runs).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HOME=/opt/kvscope/hf \
    KVSCOPE_HOME=/opt/kvscope/home

# 1. The CPU build of torch first, from PyTorch's CPU index: a plain `pip install torch` would pull the
#    multi-GB CUDA build. pyproject.toml pins torch==2.13.0, which this 2.13.0+cpu wheel satisfies.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# 2. The app, installed in place (editable): templates/ and static/ are read from /app at run time.
WORKDIR /app
COPY pyproject.toml README.md ./
COPY app ./app
RUN pip install -e . \
 && python -c "import torch; assert torch.__version__.endswith('+cpu'), torch.__version__" \
 && useradd --create-home --uid 1000 kvscope \
 && mkdir -p /opt/kvscope/hf /opt/kvscope/home \
 && chown -R kvscope:kvscope /opt/kvscope

# 3. The models, fetched and trained as the user the server runs as (uid 1000, `kvscope`), so its files
#    stay writable for it (the training lab saves runs under KVSCOPE_HOME).
USER 1000:1000
RUN kvscope download distilgpt2 \
 && python -c "from app.model.builtin import ensure_builtin; from app.settings import Settings; \
from app.training.builtin import train_builtin; \
print('built-in model at', ensure_builtin(Settings.from_env().home, train=train_builtin))"

# 4. Page templates and static files last: editing them does not invalidate the layers above.
COPY --chown=kvscope:kvscope templates ./templates
COPY --chown=kvscope:kvscope static ./static

# From here on nothing may reach the hub: models load from the cache filled in step 3.
ENV HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["kvscope", "serve", "--host", "0.0.0.0"]
