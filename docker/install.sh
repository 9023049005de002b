#!/bin/sh
# The image's Python packages, into the venv on the PATH (the Dockerfile's build stage).
#
#   docker/install.sh deps   the dependencies (pyproject.toml; the package itself still empty)
#   docker/install.sh app    the package, without touching a dependency; then /opt/mempo
#
# Where from: the wheels in /tmp/wheels when there are any (an air-gapped build: nothing
# else is read), else the package index with PyTorch's CPU index beside it. What versions:
# every package the base image already ships stays as it is (a GPU base's torch, SGLang's
# stack); on a base without torch, the tested CPU stack (constraints/cpu.txt).
set -eu

if ls /tmp/wheels/*.whl >/dev/null 2>&1; then
  set -- "$1" --no-index --find-links /tmp/wheels
else
  set -- "$1" --extra-index-url https://download.pytorch.org/whl/cpu
fi
step=$1
shift

case "$step" in
  deps)
    python -m pip list --format=freeze --exclude pip --exclude setuptools --exclude wheel > /tmp/image.txt
    if python -c "import torch" 2>/dev/null; then
      echo "install: the base image ships torch $(python -c 'import torch; print(torch.__version__)'): kept"
    else
      cat constraints/cpu.txt >> /tmp/image.txt
    fi
    python -m pip install "$@" -c /tmp/image.txt ".[all]"
    ;;
  app)
    python -m pip install "$@" --no-deps --force-reinstall .
    python -c "import mempo, services.retrieval.app, services.scorer.app, services.rollout.app, services.learner.app"
    # on SGLang's image: the release our engine client is audited against (tests/contract)
    python -c "
import importlib.metadata as m
from mempo.api.engine import SGLANG_VERSION as want
try:
    got = m.version('sglang')
except m.PackageNotFoundError:
    got = want
assert got == want, f'the base image has sglang {got}, the client is audited against {want}'"
    # the shipped pretrained tiny model at a fixed path (the CPU stack's default policy)
    mkdir -p /opt/mempo
    python -c "import shutil; from mempo_sim.tiny import PRESETS, shipped; shutil.copytree(shipped(PRESETS['reader']), '/opt/mempo/tiny')"
    ;;
  *)
    echo "install: deps or app (got '$step')" >&2
    exit 2
    ;;
esac
