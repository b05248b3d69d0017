#!/usr/bin/env bash
# One call on a lent GPU machine: flowmoe installed (editable, no dependencies) into the machine's
# own Python beside its CUDA torch, then the parts named in $PARTS, in that order:
#   bench    bench/gpu.py: every scheduler and Accelerate's offload at $BENCH_ARGS' budgets, each row
#            synced to $OUT/gpu.jsonl as it finishes, with each thread group's CPU seconds per decode
#            step (feed the file to `python bench/realtime_overhead.py --h200 --threads gpu.jsonl`)
#   int4     bench/gpu.py with --expert-format int4 ($INT4_ARGS): the experts cross the link packed,
#            dequantized at first use on the compute stream (int4.log's first line: the triton used)
#   hooks    bench/accelerate_hooks.py --device cuda: Accelerate's offload hook per call and tensor
#            with real moves to the GPU (the empty_cache after each), and over an expert's copy
#   checks   the test suite with CUDA visible, and beside it a --trace-kernels run of the built-in
#            model (do CUDA's kernels land on their nodes?)
#   slots    the device's experts in slots (FLOWMOE_EXPERT_SLOTS=1, off on CUDA until checked here)
# Each part has its own time limit, so one that runs long leaves the others their share. At most 8
# files come back from $OUT: the rows, logs and test output are written there as they go; everything
# else (traces, machine, kernels run, hooks) lands in /tmp/gpu-work and is packed into $OUT/rest.tgz
# after every part, so a call cut short keeps what finished.
#
#   PARTS="bench int4 hooks checks" BENCH_ARGS="--budgets t4 --new-tokens 8" bash bench/gpu_call.sh
#   PARTS="bench" BENCH_ARGS="--schedulers cgopipe --budgets t4" bash bench/gpu_call.sh
#
# Packages the image lacks travel as wheels in .whl/ (the machine reaches no registry; its Python
# is 3.12). Fetch them here first, with the versions of this checkout's venv:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_17_x86_64 -d .whl structlog pytest-asyncio import-linter grimp
# Run it from a snapshot of the commit being measured (git archive HEAD into an ignored folder,
# .whl copied in, that folder carried), so edits in progress in the checkout do not travel.
set -u
OUT=${OUT:-/tmp/flowmoe-gpu-out}
WORK=/tmp/gpu-work
BENCH_S=${BENCH_S:-310}
BENCH_ARGS=${BENCH_ARGS:-}
INT4_S=${INT4_S:-65}
INT4_ARGS=${INT4_ARGS:---schedulers cgopipe klotski on-demand --budgets t4 --new-tokens 8}
HOOKS_S=${HOOKS_S:-40}
TESTS_S=${TESTS_S:-150}
KERNELS_S=${KERNELS_S:-90}
SLOTS_S=${SLOTS_S:-240}
PARTS=${PARTS:-bench checks}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    lscpu | grep -E "Model name|^CPU\(s\)|^Flags"
    python3 --version
} >"$WORK/machine.txt" 2>&1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps .whl/*.whl || exit 2
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$WORK/machine.txt" 2>&1 || exit 2
python3 -c "import torch, flowmoe; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" \
    | tee -a "$WORK/machine.txt"

pack() {  # what finished so far, in the one file that carries the rest back
    tar czf "$OUT/rest.tgz.part" -C "$WORK" . && mv "$OUT/rest.tgz.part" "$OUT/rest.tgz"
}

bench() {
    timeout "$BENCH_S" python3 bench/gpu.py --hardware h200 --out "$OUT/gpu.jsonl" \
        --trace-dir "$WORK/traces" --results "$WORK/results.md" $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
    gzip -f "$WORK"/traces/*.json 2>/dev/null
}

int4() {
    python3 -c "import triton; print('triton', triton.__version__)" >"$WORK/int4.log" 2>&1
    timeout "$INT4_S" python3 bench/gpu.py --hardware h200 --expert-format int4 --no-accelerate \
        --out "$OUT/gpu-int4.jsonl" --trace-dir "$WORK/traces-int4" --results "$WORK/results-int4.md" \
        $INT4_ARGS >>"$WORK/int4.log" 2>&1
    gzip -f "$WORK"/traces-int4/*.json 2>/dev/null
    tail -n 12 "$WORK/int4.log"
}

hooks() {
    timeout "$HOOKS_S" python3 bench/accelerate_hooks.py --device cuda --out "$WORK/hooks.json" 2>&1 \
        | tee "$WORK/hooks.txt"
}

checks() {
    (
        timeout "$KERNELS_S" python3 -m flowmoe.cli run --device cuda --scheduler cgopipe --max-new-tokens 3 \
            --prompts examples/prompts.jsonl --output "$WORK/k.jsonl" --micro-batches 2 --trace "$WORK/k.json" \
            --trace-kernels >"$WORK/kernels.txt" 2>&1
        python3 -m flowmoe.cli trace summarize "$WORK/k.json" >>"$WORK/kernels.txt" 2>&1
        gzip -f "$WORK/k.json"
    ) &
    local beside=$!
    timeout "$TESTS_S" python3 -m pytest -q -n 12 -p no:cacheprovider --timeout 120 \
        -rfE --ignore tests/test_lint.py tests >"$OUT/tests.txt" 2>&1
    wait "$beside"
    tail -n 25 "$OUT/tests.txt"
    tail -n 20 "$WORK/kernels.txt"
}

slots() {
    FLOWMOE_EXPERT_SLOTS=1 timeout "$SLOTS_S" python3 -m pytest -q -n 12 -p no:cacheprovider \
        --timeout 120 -rfE tests/test_scheduler_contract.py tests/test_expert_slots.py \
        tests/test_grouped_experts.py >"$WORK/slots-tests.txt" 2>&1
    tail -n 15 "$WORK/slots-tests.txt"
    FLOWMOE_EXPERT_SLOTS=1 timeout "$SLOTS_S" python3 bench/gpu.py --hardware h200 \
        --out "$WORK/gpu-slots.jsonl" --trace-dir "$WORK/traces-slots" --results "$WORK/results-slots.md" \
        --schedulers cgopipe on-demand --budgets t4 2>&1 | tee "$WORK/bench-slots.log"
}

for part in $PARTS; do
    echo "== $part $(date -u +%T)" | tee -a "$WORK/machine.txt"
    "$part"
    pack
done
echo "== done $(date -u +%T)" | tee -a "$WORK/machine.txt"
pack
