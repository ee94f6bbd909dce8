# The gdn2 trainer on NVIDIA GPUs.
#
#   docker build -t gdn2 .
#   docker run --gpus all --ipc=host -v "$PWD/data:/workspace/gdn2/data" -v "$PWD/out:/workspace/gdn2/out" \
#       gdn2 --config swa_gdn2_tiny                          # one GPU (or the CPU without --gpus)
#   docker run --gpus all --ipc=host -v ... --entrypoint scripts/pretrain_local.sh gdn2 swa_gdn2_1.3B
#                                                            # every GPU of the machine, FSDP
#
# --ipc=host gives the data-loader workers enough shared memory. Under SLURM with a container runtime
# (pyxis/enroot), run `python pretrain/main.py ...` inside the image from the same srun line as
# scripts/pretrain_1.3B.sh. Another base works the same way (e.g. nvcr.io/nvidia/pytorch:25.06-py3):
# docker build --build-arg BASE=... -t gdn2 .
ARG BASE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
FROM ${BASE}

# Triton compiles a small C launcher for every kernel at run time, which needs a C compiler.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /workspace/gdn2

# Dependencies first, read from pyproject.toml (torch and triton come with the base image and satisfy its
# bounds), so that editing the code does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY . .
RUN pip install --no-deps -e . \
    && python -c "import gdn2.train.loop, gdn2.model, gdn2.data_prep.prepare, gdn2.eval.run; from gdn2.config import Config; Config.from_name('swa_gdn2_1.3B')"

ENTRYPOINT ["python", "pretrain/main.py"]
CMD ["--help"]
