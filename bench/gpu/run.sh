#!/usr/bin/env bash
# Run the GPU checks on a lent H100/H200 in one call: installs the carried wheels (.whl) and
# Debian packages (.debs: redis-server, bubblewrap), starts the whole farm there and runs one
# part of bench/gpu/run.py. Results and farm logs land in $OUT.
#
#   device run, carry [.whl, .debs]:  bash bench/gpu/run.sh PART... (default|autotune|smoke|miss|hit|profile|prepare|spread|device|ddp|coverage|never_wait|aoti|zoo|zoo_cpu|parity|sibling|novel|skipcheck|miss_profile)
# coverage runs bench/coverage/suite.py (ONLY=a,b,... for a subset) on the GPU, with the
# transformers that the machine's image already holds.
# Prepare the carried files here once with `bash bench/gpu/fetch-deps.sh`.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: run.sh PART... (default|autotune|smoke|miss|hit|profile|prepare|spread|device|ddp|coverage|never_wait|aoti|zoo|zoo_cpu|parity|sibling|novel|skipcheck|miss_profile)" >&2; exit 2; }
OUT=${OUT:-/tmp/torchfarm-bench}
mkdir -p "$OUT"

# Byte-compiled as pip does for a user (the image sets PYTHONDONTWRITEBYTECODE=1, so nothing
# imported later writes a .pyc: without this every client process compiles grpc's and the
# farm's sources again, a cost no installed torchfarm has).
python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
# Installed for its entry point (the "torchfarm" Dynamo backend), but the code runs from this
# tree: pip's build/ dir, which a warm machine keeps between calls, can be older than the tree.
rm -rf build /tmp/site/torchfarm /tmp/site/torchfarm-*.dist-info
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .
export PYTHONPATH=$PWD:/tmp/site
python3 -m compileall -q -j 0 torchfarm bench >/dev/null
# The image's own packages too: it was built with PYTHONDONTWRITEBYTECODE=1 and holds no .pyc
# for torch, so each process compiled the ~170-220 torch modules a warm start imports from
# source (1.2-1.6 s of it under cProfile, 2026-11-29), which no pip-installed torch does.
python3 -m compileall -q -j 0 "$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true

mkdir -p /tmp/debs
for deb in .debs/*.deb; do dpkg -x "$deb" /tmp/debs; done
export PATH=/tmp/debs/usr/bin:$PATH
export LD_LIBRARY_PATH=/tmp/debs/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}

# Count real Triton compiles in the clients: every kernel compile runs ptxas once.
REAL_PTXAS=$(python3 -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas"))')
mkdir -p /tmp/tf-bin
printf '#!/bin/sh\n[ -n "$TF_PTXAS_LOG" ] && echo "$*" >> "$TF_PTXAS_LOG"\nexec %s "$@"\n' "$REAL_PTXAS" > /tmp/tf-bin/ptxas
chmod +x /tmp/tf-bin/ptxas
export TRITON_PTXAS_PATH=/tmp/tf-bin/ptxas

if bwrap --ro-bind / / --dev /dev --unshare-net true; then
    export TORCHFARM_SANDBOX=bwrap
else
    echo "!!! bwrap cannot run here: this run uses --sandbox none" >&2
    export TORCHFARM_SANDBOX=none
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
for PART in "$@"; do  # each part starts a farm of its own
    if [ "$PART" = coverage ]; then
        PYTHONUNBUFFERED=1 python3 bench/coverage/suite.py --device cuda --scale large \
            --parallel 4 --sandbox "$TORCHFARM_SANDBOX" --only "${ONLY:-}" --out "$OUT" \
            --machine "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), 16 cores"
    elif [ "$PART" = ddp ]; then  # needs 2 GPUs (nvidia-h200-x2): one rank per GPU; DDP_MODELS
        # (default blocks; zoo:NAME too), one bench each, each with an empty farm of its own
        IFS=, read -ra DDP_ALL <<< "${DDP_MODELS:-blocks}"
        for m in "${DDP_ALL[@]}"; do
            logs="$OUT/ddp-logs-${m#zoo:}"; mkdir -p "$logs"
            PYTHONUNBUFFERED=1 timeout "${DDP_TIMEOUT:-300}" python3 bench/ddp.py --device cuda --model "$m" \
                --json "$OUT/results-ddp-${m#zoo:}.json" --log-dir "$logs" \
                || echo "ddp $m failed ($?)"
        done
    elif [ "$PART" = never_wait ]; then  # issue 20: MODELS (default gpt), MODES, STEPS, FARM_GPU/CLIENT_GPU
        PYTHONUNBUFFERED=1 python3 bench/never_wait.py --device cuda --models "${MODELS:-gpt}" \
            --modes "${MODES:-default}" --steps "${STEPS:-200}" --json "$OUT/never_wait.json" \
            ${FARM_GPU:+--farm-gpu "$FARM_GPU" --client-gpu "${CLIENT_GPU:-0}"} || echo "never_wait failed ($?)"
    elif [ "$PART" = aoti ]; then  # issue 30: AOTInductor packages, local vs farm (MODELS)
        PYTHONUNBUFFERED=1 python3 bench/aoti.py --device cuda --models "${MODELS:-gpt,resnet50}" \
            --rows "${ROWS:-local,farm miss,farm hit,farm sent}" --json "$OUT/aoti.json" \
            || echo "aoti failed ($?)"
    elif [ "$PART" = zoo ]; then  # issue 49: the hit part's rows for ZOO_MODELS, split over
        # ZOO_RUNNERS runners (default: one per GPU), each a run.py with its own farm on GPU
        # r % GPUS and cores of its own, side by side, each model's processes one after another
        # in its runner; rows stream to $OUT/zoo-runnerN/log.txt (MODE, BENCH_STEADY=0 pass through;
        # ZOO_PART=novel runs run.py's novel part instead of hit; ZOO_MODES=a,b: runner r's MODE
        # is the (r mod 2)th, e.g. max-autotune beside default in one call; ZOO_ENVS="A=0,B=1;A=1":
        # runner r's extra environment the (r mod count)th, its farm's too; ZOO_SPLIT=0: every
        # runner runs every model, e.g. a worker setting off beside on, each on a GPU of its own)
        ZOO_MODELS=${ZOO_MODELS:-zoo:llama,zoo:qwen3,zoo:gpt2,zoo:gpt-neox,zoo:deberta-v2,zoo:chatglm-encoder,zoo:timm-convnext,zoo:unet}
        GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
        RUNNERS=${ZOO_RUNNERS:-$GPUS}; PER=$(( $(nproc) / RUNNERS ))
        IFS=, read -ra ALL <<< "$ZOO_MODELS"
        IFS=, read -ra MODES <<< "${ZOO_MODES:-${MODE:-default}}"  # runner r: MODES[r % count]
        IFS=';' read -ra ENVS <<< "${ZOO_ENVS:-}"; [ ${#ENVS[@]} -gt 0 ] || ENVS=("")
        for ((r = 0; r < RUNNERS; r++)); do
            step=$RUNNERS; first=$r; [ "${ZOO_SPLIT:-1}" = 0 ] && { step=1; first=0; }
            mine=(); for ((i = first; i < ${#ALL[@]}; i += step)); do mine+=("${ALL[i]}"); done
            [ ${#mine[@]} -gt 0 ] || continue
            mkdir -p "$OUT/zoo-runner$r"
            extra=${ENVS[r % ${#ENVS[@]}]}
            (IFS=,; [ -z "$extra" ] || export $extra; MODE=${MODES[r % ${#MODES[@]}]} CUDA_VISIBLE_DEVICES=$((r % GPUS)) MODELS="${mine[*]}" BENCH_STEADY=${BENCH_STEADY:-1} PYTHONUNBUFFERED=1 \
                timeout "${ZOO_TIMEOUT:-480}" taskset -c $((r * PER))-$((r * PER + PER - 1)) \
                python3 bench/gpu/run.py --part "${ZOO_PART:-hit}" --out "$OUT/zoo-runner$r" \
                > "$OUT/zoo-runner$r/log.txt" 2>&1 || echo "zoo runner $r failed ($?)") &
        done
        wait
    elif [ "$PART" = zoo_cpu ]; then  # issue 49: the CPU zoo (tests/zoo/runner.py, the skip on)
        # with this machine's torch, on its cores: ZOO_GROUPS runners side by side, each with
        # its own farm, pinned to cores of its own (no GPU); a JSON and a table per runner
        ZOO_MODELS=${ZOO_MODELS:-$(python3 -c 'from tests.zoo import models; print(",".join(models.NAMES))')}
        NGROUPS=${ZOO_GROUPS:-5}; PER=$(( $(nproc) / NGROUPS ))
        IFS=, read -ra ALL <<< "$ZOO_MODELS"
        for ((g = 0; g < NGROUPS; g++)); do
            mine=(); for ((i = g; i < ${#ALL[@]}; i += NGROUPS)); do mine+=("${ALL[i]}"); done
            [ ${#mine[@]} -gt 0 ] || continue
            (IFS=,; CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=$PER PYTHONUNBUFFERED=1 \
                timeout "${ZOO_TIMEOUT:-540}" taskset -c $((g * PER))-$((g * PER + PER - 1)) \
                python3 -m tests.zoo.runner --models "${mine[*]}" --json "$OUT/zoo-cpu-$g.json" \
                > "$OUT/zoo-cpu-$g.txt" 2>&1 || echo "zoo_cpu group $g failed ($?)") &
        done
        wait
    elif [ "$PART" = device ]; then  # one compile for every rank (issue 18): cuda:N loads
        PYTHONUNBUFFERED=1 timeout "${DEVICE_TIMEOUT:-300}" python3 bench/gpu/device_index.py --out "$OUT" || echo "device check failed ($?)"
    else
        PYTHONUNBUFFERED=1 python3 bench/gpu/run.py --part "$PART" --out "$OUT" || echo "part $PART failed ($?)"
    fi
done
