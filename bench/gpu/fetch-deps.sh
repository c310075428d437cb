#!/usr/bin/env bash
# Fetch what bench/gpu/run.sh carries to the GPU machine (no internet there): CPython 3.12
# x86-64 wheels of the server extra's packages into .whl/, and Debian's redis-server and
# bubblewrap packages into .debs/. Both folders are ignored by git (.gitignore).
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .debs
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform any -d .whl \
    celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 redis==8.1.0 \
    zstandard==0.25.0 grpcio==1.85.1 grpcio-health-checking==1.85.1 protobuf==7.36.2 \
    click==8.5.1 click-didyoumean==0.3.1 click-plugins==1.1.1.2 click-repl==0.4.1 \
    prompt_toolkit==3.0.53 wcwidth==0.9.4 tzlocal \
    grpcio-reflection==1.85.1 prometheus-client==0.26.0 typer==0.29.2 annotated-doc==0.0.7 \
    rich==15.0.0 shellingham==1.5.4 markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.21.0 \
    pydantic==2.14.3 pydantic-core==2.50.4 typing-inspection==0.4.5 annotated-types==0.8.0 \
    typing-extensions==4.16.0
# The zoo's diffusers models (tests/zoo): the image has transformers, timm, torchvision and
# diffusers' other needs (huggingface-hub 1.33, pillow, regex, requests), not these.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any -d .whl diffusers==0.42.1 importlib_metadata==8.7.0
# Entry signatures (cryptography; an abi3 wheel) and what it needs.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    cryptography==50.0.2 cffi==2.1.1 pycparser==3.12
(cd .debs && apt-get download redis-server redis-tools liblzf1 libjemalloc2 bubblewrap)
