#!/usr/bin/env bash
# One call on a lent GPU machine: flowmoe installed (editable, no dependencies) into the machine's
# own Python beside its CUDA torch, then the parts named in $PARTS: the test suite with CUDA
# visible, bench/gpu.py (its rows synced to $OUT as each finishes), a --trace-kernels run of the
# built-in model. Every bench row carries each thread group's CPU seconds per decode step ("thread_cpu";
# the bench prints them as a table at the end): feed gpu.jsonl to
# `python bench/realtime_overhead.py --h200 --threads gpu.jsonl` for item 4's check.
# Each part has its own time limit so one that runs long leaves the others their share; everything worth keeping lands in $OUT (at most 8 files come back).
#
#   BENCH_ARGS="--budgets t4" BENCH_S=330 TESTS_S=150 bash bench/gpu_call.sh
#   PARTS="bench kernels tests" BENCH_ARGS="--schedulers cgopipe --budgets t4" bash bench/gpu_call.sh
#   PARTS="slots bench" BENCH_ARGS="--schedulers cgopipe on-demand --budgets t4" bash bench/gpu_call.sh
#
# Packages the image lacks travel as wheels in .whl/ (the machine reaches no registry; its Python
# is 3.12). Fetch them here first, with the versions of this checkout's venv:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl structlog pytest-asyncio import-linter grimp
# Run it from a snapshot of the commit being measured (git archive HEAD into an ignored folder,
# .whl copied in, that folder carried), so edits in progress in the checkout do not travel.
set -u
OUT=${OUT:-/tmp/flowmoe-gpu-out}
BENCH_S=${BENCH_S:-330}
TESTS_S=${TESTS_S:-150}
KERNELS_S=${KERNELS_S:-60}
BENCH_ARGS=${BENCH_ARGS:-}
PARTS=${PARTS:-tests bench}  # in this order; also: kernels, slots
SLOTS_S=${SLOTS_S:-240}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)"
    python3 --version
} >"$OUT/machine.txt" 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/machine.txt" 2>&1 || exit 2
python3 -c "import torch, flowmoe; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    | tee -a "$OUT/machine.txt"

tests() {
    timeout "$TESTS_S" python3 -m pytest -q -n 12 -p no:cacheprovider --timeout 120 \
        -rfE --ignore tests/test_lint.py tests >"$OUT/tests.txt" 2>&1
    tail -n 25 "$OUT/tests.txt"
}

bench() {
    timeout "$BENCH_S" python3 bench/gpu.py --hardware h200 --out "$OUT/gpu.jsonl" \
        --trace-dir /tmp/gpu-traces $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
    for trace in /tmp/gpu-traces/t4-cgopipe.json /tmp/gpu-traces/t4-on-demand.json; do
        [ -f "$trace" ] && gzip -c "$trace" >"$OUT/$(basename "$trace").gz"
    done
}

kernels() {  # the built-in model under --trace-kernels: do CUDA's kernels land on their nodes?
    timeout "$KERNELS_S" python3 -m flowmoe.cli run --device cuda --scheduler cgopipe --max-new-tokens 3 \
        --prompts examples/prompts.jsonl --output /tmp/k.jsonl --micro-batches 2 --trace /tmp/k.json \
        --trace-kernels >"$OUT/kernels.txt" 2>&1
    python3 -m flowmoe.cli trace summarize /tmp/k.json >>"$OUT/kernels.txt" 2>&1
    [ -f /tmp/k.json ] && gzip -c /tmp/k.json >"$OUT/kernels-trace.json.gz"
    tail -n 30 "$OUT/kernels.txt"
}

slots() {  # the device's experts in slots (FLOWMOE_EXPERT_SLOTS=1, off on CUDA until checked here)
    FLOWMOE_EXPERT_SLOTS=1 timeout "$SLOTS_S" python3 -m pytest -q -n 12 -p no:cacheprovider \
        --timeout 120 -rfE tests/test_scheduler_contract.py tests/test_expert_slots.py \
        tests/test_grouped_experts.py >"$OUT/slots-tests.txt" 2>&1
    tail -n 15 "$OUT/slots-tests.txt"
    FLOWMOE_EXPERT_SLOTS=1 timeout "$BENCH_S" python3 bench/gpu.py --hardware h200 \
        --out "$OUT/gpu-slots.jsonl" --schedulers cgopipe on-demand --budgets t4 2>&1 | tee "$OUT/bench-slots.log"
}

for part in $PARTS; do
    "$part"
done
